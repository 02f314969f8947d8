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
