"""`mmcli ask`: one answer about one or more images or videos, printed, and its record appended when asked."""

from __future__ import annotations

import sys
from pathlib import Path

from mmcli.config import Config
from mmcli.errors import MmcliError


def run_ask(config: Config, images: list[Path], question: str | None, output: Path | None, logprobs: bool,
            stream: bool = True, task: str | None = None, sampling: dict | None = None,
            videos: list[Path] = ()) -> int:
    """Load, answer (streamed to stdout as it is generated, or printed whole), and append the record; returns 0,
    or 1 when the item failed (its error is on stderr and in the record)."""
    from rich.console import Console

    from mmcli.api.labeler import Labeler
    from mmcli.jobs.records import JsonlOutput
    from mmcli.cli.progress import status_line
    from mmcli.jobs.resume import load_description

    out = JsonlOutput(output).open() if output is not None else None  # locked before the work, like caption
    try:
        with status_line(Console(stderr=True), f"loading {load_description(config)}"):
            captioner = Labeler.from_pretrained(config=config)
        return _answer(captioner, images, list(videos), question, out, logprobs, stream, task, sampling or {})
    finally:
        if out is not None:
            out.close()


def _print_piece(piece: str) -> None:
    sys.stdout.write(piece)
    sys.stdout.flush()


def _answer(captioner, images: list[Path], videos: list[Path], question: str | None, out, logprobs: bool,
            stream: bool, task: str | None, sampling: dict) -> int:
    from mmcli.api.result import Result
    from mmcli.jobs.records import make_record

    captioner.report_compile_cache()
    inputs = [*images, *videos]
    try:
        result = captioner.ask([str(p) for p in images], question, on_text=_print_piece if stream else None,
                               task=task, videos=[str(p) for p in videos], **sampling)
        captioner.report_compile_use()
    except MmcliError as e:
        result = Result(str(inputs[0]), error={"type": type(e).__name__, "message": str(e)})
        print(f"mmcli: {e}", file=sys.stderr)
    if result.ok:
        print("" if stream else result.fields.get("text", result.text))
    if out is not None:
        out.append(make_record(key=str(inputs[0]), task=task or "ask", prompt=question or result.prompt,
                               result=result,
                               model=captioner.model_name, model_revision=captioner.revision,
                               sampling=result.sampling, path=inputs[0], logprobs=logprobs,
                               extra={"precision": captioner.precision,
                                      **({"images": [str(p) for p in inputs]} if len(inputs) > 1 else {})}))
    return 0 if result.ok else 1
