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
    backend: str | None = typer.Option(None, help="compile.backend: auto, eager, inductor or neuron."),
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
        cfg = load_config(config, {"model": model, "dtype": dtype, "device": device, "compile": {"backend": backend}})
        captioner = Captioner.from_pretrained(config=cfg)
        _report_compile_cache(captioner)
        params = captioner.sampling(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                    top_k=top_k, repetition_penalty=repetition_penalty, seed=seed)
    except ValueError as e:
        raise _fail(ConfigError(str(e)), 2) from None
    except MmcliError as e:
        raise _fail(e, e.exit_code) from None
    try:
        result = captioner.ask([str(p) for p in image], question, **params.as_dict())
        _report_compile_use(captioner)
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


def _image_patches(paths: list[Path], max_pixels: int, min_pixels: int = 65536, patch: int = 16,
                   merge: int = 2) -> tuple[list[str], list[int]]:
    """Patch counts smart_resize gives each image under the pixel budget (header reads only, no decoding)."""
    from PIL import Image

    from .errors import ImageError
    from .preprocess import smart_resize
    from .scan import scan

    files = [path for _, path in scan(paths)]
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


@app.command()
def caption(
    paths: list[Path] = typer.Argument(..., help="Image folders or files."),
    model: str | None = typer.Option(None, help="Hub id or local checkpoint directory."),
    config: Path | None = typer.Option(None, "--config", "-c", help="YAML settings file."),
    output: str = typer.Option("captions.jsonl", "--output", "-o", help="JSONL file to append to; - for stdout."),
    prompt: str | None = typer.Option(None, help="The caption prompt (default: the config's)."),
    max_new_tokens: int | None = typer.Option(None),
    temperature: float | None = typer.Option(None, help="0 is greedy."),
    seed: int | None = typer.Option(None),
    dtype: str | None = typer.Option(None, help="auto, float32, bfloat16 or float16."),
    device: str | None = typer.Option(None, help="auto, cpu or cuda."),
    backend: str | None = typer.Option(None, help="compile.backend: auto, eager, inductor or neuron."),
    logprobs: bool = typer.Option(False, "--logprobs", help="Add token_ids and logprobs to each record."),
    recursive: bool = typer.Option(True, "--recursive/--no-recursive"),
    include: list[str] = typer.Option([], "--include", help="Only keys matching this glob (repeatable)."),
    exclude: list[str] = typer.Option([], "--exclude", help="Skip keys matching this glob (repeatable)."),
    shard: str | None = typer.Option(None, help="I/N: only the keys of shard I of N (stable hash)."),
    limit: int | None = typer.Option(None, help="At most this many items."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Redo items already recorded."),
    retry_errors: bool = typer.Option(False, "--retry-errors", help="Redo items recorded as errors."),
    sidecar: str | None = typer.Option(None, help="Also write each caption next to its image, e.g. .txt."),
    dry_run: bool = typer.Option(False, "--dry-run", help="List what would be captioned, then stop."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress or summary (for cron)."),
    ray: bool = typer.Option(False, "--ray", help="Run on a Ray cluster (pip install 'mmcli[ray]')."),
    ray_address: str | None = typer.Option(None, help="Ray cluster address (default: start a local instance)."),
    replicas: int = typer.Option(1, help="With --ray: model replicas, one engine each."),
    replica_resources: str | None = typer.Option(
        None, help='With --ray: JSON per replica, e.g. \'{"num_cpus": 4}\' or \'{"resources": {"neuron_cores": 2}}\'.'),
) -> None:
    """Caption every image under PATHS, appending one JSONL record per image; resumable."""
    from .config import load_config
    from .output import JsonlOutput, OutputLocked, settings_hash
    from .scan import parse_shard, scan, shard_of

    try:
        if ray:
            from .distributed import parse_resources, require_ray

            require_ray()
            resources = parse_resources(replica_resources)
        overrides = {"model": model, "dtype": dtype, "device": device, "prompt": prompt,
                     "compile": {"backend": backend},
                     "generation": {"max_new_tokens": max_new_tokens, "temperature": temperature, "seed": seed}}
        cfg = load_config(config, overrides)
        items = scan(paths, cfg.scan.extensions, recursive=recursive, include=include, exclude=exclude)
        if shard:
            index, count = parse_shard(shard)
            items = [(k, p) for k, p in items if shard_of(k, count) == index]
    except (ValueError, FileNotFoundError) as e:
        raise _fail(e, 2) from None
    except MmcliError as e:
        raise _fail(e, e.exit_code) from None
    sampling = {k: getattr(cfg.generation, k) for k in ("temperature", "top_p", "top_k", "repetition_penalty",
                                                         "max_new_tokens", "seed")}
    settings = settings_hash(cfg.prompt, cfg.model, sampling)
    out = None
    if output != "-":
        try:
            out = JsonlOutput(Path(output)).open()
        except OutputLocked as e:
            raise _fail(e, 2) from None
        except OSError as e:
            raise _fail(f"{output}: cannot write ({e.strerror})", 3) from None
        if out.set_aside and not quiet:
            typer.echo(f"mmcli: {output}: a torn last line from an interrupted run was moved to {out.set_aside}",
                       err=True)
        if not overwrite:
            recorded = {r.get("key"): r.get("status") for r in out.records() if r.get("settings") == settings}
            items = [(k, p) for k, p in items if recorded.get(k) is None
                     or (recorded[k] == "error" and retry_errors)]
    if limit is not None:
        items = items[:limit]
    if dry_run or not items:
        if not quiet:
            for key, _ in items:
                typer.echo(key)
            typer.echo(f"mmcli: {len(items)} images to caption", err=True)
        if out:
            out.close()
        raise typer.Exit(0)
    import signal

    from .output import append_record, write_sidecar
    from .progress import Progress

    paths = dict(items)
    progress = Progress(len(items), quiet=quiet)

    def write(record: dict) -> None:
        if out:
            out.append(record)
        else:
            append_record(sys.stdout, record)
        if sidecar and record["status"] == "ok":
            write_sidecar(paths[record["key"]], sidecar, record["text"])
        progress.update(record)

    def on_term(signum, frame):  # SIGTERM ends the run like Ctrl-C: what finished is already on disk
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_term)
    code = 0
    try:
        if ray:
            from .distributed import caption_on_ray

            caption_on_ray(items, cfg, settings, write, ray_address, replicas, resources, logprobs)
        else:
            _caption_local(cfg, items, settings, sampling, logprobs, write)
        progress.finish()
        code = 1 if progress.failed else 0
    except KeyboardInterrupt:
        progress.finish(interrupted=True)
        code = 130
    except MmcliError as e:
        typer.echo(f"mmcli: {e}", err=True)
        code = e.exit_code
    finally:
        signal.signal(signal.SIGTERM, previous)
        if out:
            out.close()
    raise typer.Exit(code)


def _caption_local(cfg, items, settings, sampling, logprobs, write) -> None:
    from .captioner import Captioner
    from .output import file_sha256, make_record

    captioner = Captioner.from_pretrained(config=cfg)
    _report_compile_cache(captioner)
    paths = dict(items)
    try:
        for result in captioner.caption(items, prompt=cfg.prompt, **sampling):
            write(make_record(key=result.key, task="caption", prompt=cfg.prompt, result=result,
                              model=captioner.model_name, model_revision=captioner.revision, sampling=sampling,
                              sha256=file_sha256(paths[result.key]), logprobs=logprobs,
                              extra={"settings": settings}))
    finally:
        _report_compile_use(captioner)


def _report_compile_cache(captioner) -> None:
    """With a compiled backend: say which configured buckets were not compiled ahead (they will run eagerly)."""
    graphs = captioner.runner.graphs
    if graphs is None:
        return
    missing = graphs.missing
    if missing:
        shown = ", ".join(b.label for b in missing[:6]) + (" …" if len(missing) > 6 else "")
        typer.echo(f"mmcli: {graphs.backend} compile cache {graphs.cache_dir}: {len(missing)} of "
                   f"{len(graphs.buckets)} buckets not compiled ahead ({shown}); they run eagerly, never compiled "
                   "mid-run: `mmcli compile --buckets` compiles them", err=True)


def _report_compile_use(captioner) -> None:
    graphs = captioner.runner.graphs
    if graphs is None:
        return
    eager = ", ".join(b.label for b in graphs.missing_used) or "none"
    typer.echo(f"mmcli: {graphs.backend}: {len(graphs.loaded)} buckets loaded from the compile cache, "
               f"{len(graphs.compiled_at_run_time)} compiled in this run; shapes run eagerly: {eager}", err=True)


@app.command("compile")
def compile_cmd(
    bucket_list: str | None = typer.Argument(None, metavar="[LIST]",
                                             help="Only these buckets, e.g. 'decode 8x1024, prefill 512'."),
    buckets: bool = typer.Option(False, "--buckets", help="Compile the configured buckets (or those in LIST)."),
    model: str | None = typer.Option(None, help="Hub id or local checkpoint directory."),
    config: Path | None = typer.Option(None, "--config", "-c", help="YAML settings file."),
    dtype: str | None = typer.Option(None, help="auto, float32, bfloat16 or float16."),
    device: str | None = typer.Option(None, help="auto, cpu or cuda."),
    backend: str | None = typer.Option(None, help="compile.backend: inductor or neuron."),
) -> None:
    """Compile and cache every fixed-shape bucket ahead of time (vision blocks, prefill, decode)."""
    import time

    from rich.console import Console
    from rich.table import Table

    from .captioner import Captioner
    from .compiled import parse_buckets
    from .config import load_config

    started = time.perf_counter()
    try:
        if not buckets:
            raise ConfigError("say --buckets (every configured bucket) or --buckets 'decode 8x1024, ...'")
        cfg = load_config(config, {"model": model, "dtype": dtype, "device": device, "compile": {"backend": backend}})
        if cfg.compile.backend in ("auto", "eager"):
            raise ConfigError(f"compile.backend {cfg.compile.backend} runs eagerly here: nothing to compile "
                              "(choose --backend inductor or neuron)")
        captioner = Captioner.from_pretrained(config=cfg)
        graphs = captioner.runner.graphs
        todo = parse_buckets(bucket_list, graphs.buckets) if bucket_list else graphs.buckets
    except ValueError as e:
        raise _fail(ConfigError(str(e)), 2) from None
    except MmcliError as e:
        raise _fail(e, e.exit_code) from None
    console = Console(width=100, stderr=False)
    table = Table(title=f"{graphs.backend} buckets in {graphs.cache_dir}")
    for col in ("component", "bucket shape", "seconds", "status"):
        table.add_column(col, justify="right" if col == "seconds" else "left")
    counts: dict[str, int] = {}
    for bucket in todo:
        status, seconds = graphs.compile_bucket(bucket, captioner.runner.warm)
        counts[status.split()[0]] = counts.get(status.split()[0], 0) + 1
        table.add_row(bucket.component, "x".join(map(str, bucket.shape)), f"{seconds:.1f}", status)
    console.print(table)
    summary = ", ".join(f"{n} {status}" for status, n in counts.items())
    console.print(f"{len(todo)} buckets ({summary}) in {time.perf_counter() - started:.1f} s")


@app.command("config")
def config_cmd(
    action: str = typer.Argument("show", help="show: print the effective settings as YAML."),
    config: Path | None = typer.Option(None, "--config", "-c", help="YAML settings file."),
) -> None:
    """Print the effective configuration (defaults updated by --config)."""
    import yaml

    from .config import config_as_dict, load_config

    if action != "show":
        raise _fail(f"config {action!r}: only 'show' is known", 2)
    try:
        cfg = load_config(config)
    except MmcliError as e:
        raise _fail(e, e.exit_code) from None
    def plain(value):  # tuples as YAML lists
        return {k: plain(v) for k, v in value.items()} if isinstance(value, dict) else \
            list(value) if isinstance(value, tuple) else value

    data = plain(config_as_dict(cfg))
    typer.echo(yaml.safe_dump(data, sort_keys=False).rstrip())
