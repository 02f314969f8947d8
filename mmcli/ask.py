"""`mmcli ask`: one answer about one or more images, printed, and its record appended when asked."""

from __future__ import annotations

import sys
from pathlib import Path

from .config import Config
from .errors import MmcliError


def run_ask(config: Config, images: list[Path], question: str, output: Path | None, logprobs: bool) -> int:
    """Load, answer, print; returns 0, or 1 when the item failed (its error is on stderr and in the record)."""
    from .captioner import Captioner, Result
    from .output import JsonlOutput, file_sha256, make_record

    captioner = Captioner.from_pretrained(config=config)
    captioner.report_compile_cache()
    try:
        result = captioner.ask([str(p) for p in images], question)
        captioner.report_compile_use()
    except MmcliError as e:
        result = Result(str(images[0]), error={"type": type(e).__name__, "message": str(e)})
        print(f"mmcli: {e}", file=sys.stderr)
    if result.ok:
        print(result.text)
    if output is not None:
        record = make_record(key=str(images[0]), task="ask", prompt=question, result=result,
                             model=captioner.model_name, model_revision=captioner.revision,
                             sampling=config.generation.as_dict(), sha256=file_sha256(images[0]), logprobs=logprobs,
                             extra={"images": [str(p) for p in images]} if len(images) > 1 else None)
        out = JsonlOutput(output).open()
        try:
            out.append(record)
        finally:
            out.close()
    return 0 if result.ok else 1
