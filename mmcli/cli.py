"""The `mmcli` command line (Typer)."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from .errors import ConfigError, MmcliError

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Caption and question image datasets with Qwen3-VL; results as JSONL.")


@app.callback()
def _root() -> None:
    """Caption and question image datasets with Qwen3-VL; results as JSONL."""


def _fail(error: Exception | str, code: int) -> typer.Exit:
    typer.echo(f"mmcli: {error}", err=True)
    return typer.Exit(code)


@app.command()
def ask(
    question: str = typer.Argument(..., help="The question about the image(s)."),
    image: list[Path] = typer.Option(..., "--image", "-i", help="An image file; repeat for several."),
    model: str | None = typer.Option(None, help="Hub id or local checkpoint directory."),
    config: Path | None = typer.Option(None, "--config", "-c", help="YAML settings file."),
    dtype: str | None = typer.Option(None, help="auto, float32, bfloat16 or float16."),
    device: str | None = typer.Option(None, help="auto, cpu or cuda."),
    max_new_tokens: int | None = typer.Option(None, help="Most tokens to generate."),
    temperature: float | None = typer.Option(None, help="0 is greedy."),
    top_p: float | None = typer.Option(None),
    top_k: int | None = typer.Option(None),
    repetition_penalty: float | None = typer.Option(None),
    seed: int | None = typer.Option(None),
    logprobs: bool = typer.Option(False, "--logprobs", help="Add token_ids and logprobs to the record."),
    output: Path | None = typer.Option(None, "--output", "-o", help="Append the JSONL record to this file."),
) -> None:
    """Answer one question about one or more images."""
    from .captioner import Captioner
    from .config import load_config
    from .output import append_record, file_sha256, make_record

    try:
        cfg = load_config(config, {"model": model, "dtype": dtype, "device": device})
        captioner = Captioner.from_pretrained(config=cfg)
        params = captioner.sampling(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                    top_k=top_k, repetition_penalty=repetition_penalty, seed=seed)
    except ValueError as e:
        raise _fail(ConfigError(str(e)), 2) from None
    except MmcliError as e:
        raise _fail(e, e.exit_code) from None
    try:
        result = captioner.ask([str(p) for p in image], question, **params.as_dict())
    except MmcliError as e:
        from .captioner import Result

        result = Result(str(image[0]), error={"type": type(e).__name__, "message": str(e)})
        typer.echo(f"mmcli: {e}", err=True)
    if result.ok:
        typer.echo(result.text)
    if output is not None:
        record = make_record(key=str(image[0]), task="ask", prompt=question, result=result,
                             model=captioner.model_name, model_revision=captioner.revision,
                             sampling=params.as_dict(), sha256=file_sha256(image[0]), logprobs=logprobs,
                             extra={"images": [str(p) for p in image]} if len(image) > 1 else None)
        try:
            with open(output, "a", encoding="utf-8") as f:
                append_record(f, record)
        except OSError as e:
            raise _fail(f"{output}: cannot write ({e.strerror})", 3) from None
    if not result.ok:
        raise typer.Exit(1)


def main() -> None:  # pragma: no cover - console entry for `python -m mmcli`
    sys.exit(app())


IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff")


def _image_patches(paths: list[Path], max_pixels: int, min_pixels: int = 65536, patch: int = 16,
                   merge: int = 2) -> tuple[list[str], list[int]]:
    """Patch counts smart_resize gives each image under the pixel budget (header reads only, no decoding)."""
    from PIL import Image

    from .errors import ImageError
    from .preprocess import smart_resize

    files = []
    for p in paths:
        files += sorted(f for f in p.rglob("*") if f.suffix.lower() in IMAGE_EXTENSIONS) if p.is_dir() else [p]
    names, patches = [], []
    for f in files:
        try:
            with Image.open(f) as im:
                w, h = im.size
                if im.getexif().get(0x0112, 1) in (5, 6, 7, 8):
                    w, h = h, w
            rh, rw = smart_resize(h, w, patch * merge, min_pixels, max_pixels)
        except (OSError, ImageError) as e:
            typer.echo(f"mmcli: {f}: skipped ({e})", err=True)
            continue
        names.append(str(f))
        patches.append((rh // patch) * (rw // patch))
    return names, patches


@app.command()
def plan(
    paths: list[Path] = typer.Argument(None, help="Image files or folders."),
    tokens: str | None = typer.Option(None, help="Patch counts instead of images, e.g. 1024,512,256,128,128."),
    block_size: int | None = typer.Option(None, help="Patches per vision block (default: the config's)."),
    config: Path | None = typer.Option(None, "--config", "-c", help="YAML settings file."),
) -> None:
    """Show how images pack into vision-attention blocks, the waste, and the block size to use."""
    from rich.console import Console
    from rich.table import Table

    from .config import load_config
    from .packing import ffd_pack, flat_efficiency, packed_efficiency, padded_efficiency, recommend_block_size

    try:
        cfg = load_config(config)
        if tokens:
            patches = [int(t) for t in tokens.split(",")]
            names = [f"#{i}" for i in range(len(patches))]
        elif paths:
            names, patches = _image_patches(paths, cfg.image.max_pixels)
        else:
            raise ConfigError("give image paths or --tokens")
        if not patches or min(patches) < 1:
            raise ConfigError("no images to plan (or a token count below 1)")
        size = block_size or cfg.vision.block_size
        bins = ffd_pack(patches, size)
    except ValueError as e:
        raise _fail(e, 2) from None
    except MmcliError as e:
        raise _fail(e, e.exit_code) from None
    console = Console(width=100)
    table = Table(title=f"{len(patches)} images in {len(bins)} blocks of {size} patches")
    for col in ("block", "images", "patches", "fill"):
        table.add_column(col, justify="right" if col != "images" else "left")
    for b, images in enumerate(bins):
        used = sum(patches[i] for i in images)
        shown = ", ".join(f"{names[i]} ({patches[i]})" for i in sorted(images)[:6])
        table.add_row(str(b), shown + (" …" if len(images) > 6 else ""), str(used), f"{100 * used / size:.1f}%")
    console.print(table)
    console.print(f"attention efficiency, blocks of {size}: {100 * packed_efficiency(patches, len(bins), size):.1f}%")
    console.print(f"attention efficiency, one flat sequence with a mask: {100 * flat_efficiency(patches):.1f}%")
    console.print(f"attention efficiency, each image padded to the largest: {100 * padded_efficiency(patches):.1f}%")
    best = recommend_block_size(patches)
    best_blocks = len(ffd_pack(patches, best))
    console.print(f"recommended block_size: {best} ({best_blocks} blocks, "
                  f"{100 * packed_efficiency(patches, best_blocks, best):.1f}% attention efficiency, least estimated "
                  f"vision work: padded linear layers plus block attention)")
