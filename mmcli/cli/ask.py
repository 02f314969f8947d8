"""`mmcli ask`: one answer about one or more images or videos, printed, and its record appended
when asked."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

from mmcli.config import Config
from mmcli.errors import MmcliError


def run_ask(
    config: Config,
    inputs: tuple[list[Path], list[Path]],
    question: str | None,
    output: Path | None,
    logprobs: bool,
    stream: bool = True,
    task: str | None = None,
    sampling: dict | None = None,
) -> int:
    """Load, answer (streamed to stdout as it is generated, or printed whole), and append the
    record; returns 0, or 1 when the item failed (its error is on stderr and in the record).
    `inputs` is (image files, video files)."""
    images, videos = inputs
    if config.weights_memory == "auto":  # one answer's few steps gain less than a copy costs
        config = replace(config, weights_memory="mapped")
    from mmcli.weights.hub import read_ahead

    read_ahead(config.model)  # before torch is imported
    from rich.console import Console

    from mmcli.api.labeler import Labeler
    from mmcli.api.loader import check_schemas, load_description, resolve_run
    from mmcli.cli.progress import status_line
    from mmcli.jobs.records import JsonlOutput
    from mmcli.tasks import resolve_tasks

    # A task that cannot run is refused before loading; answers that must parse are printed whole.
    chosen = resolve_tasks(config, [task])[0] if task is not None else None
    check_schemas(config, [chosen] if chosen is not None else [])
    stream = stream and (chosen is None or chosen.output == "text")

    # locked before the work, like caption
    out = JsonlOutput(output).open() if output is not None else None
    try:
        run = resolve_run(config)
        with status_line(Console(stderr=True), f"loading {load_description(run)}"):
            labeler = Labeler.from_run(run)
        try:
            return _answer(
                labeler, images, list(videos), question, out, logprobs, stream, task, sampling or {}
            )
        finally:  # the int8 file written while it answered: whole before the command ends
            labeler.prepared_weights_report()
    finally:
        if out is not None:
            out.close()


def _say(line: str | None) -> None:
    if line:
        print(f"mmcli: {line}", file=sys.stderr)


def _print_piece(piece: str) -> None:
    sys.stdout.write(piece)
    sys.stdout.flush()


def _answer(
    labeler,
    images: list[Path],
    videos: list[Path],
    question: str | None,
    out,
    logprobs: bool,
    stream: bool,
    task: str | None,
    sampling: dict,
) -> int:
    from mmcli.api.result import Result
    from mmcli.jobs.records import labeled_record

    _say(labeler.compile_cache_report())
    inputs = [*images, *videos]
    try:
        result = labeler.ask(
            [str(p) for p in images],
            question,
            on_text=_print_piece if stream else None,
            task=task,
            videos=[str(p) for p in videos],
            **sampling,
        )
        _say(labeler.compile_use_report())
    except MmcliError as e:
        result = Result.failed(str(inputs[0]), e)
    if result.ok:  # stdout: the record's text and a newline, streamed or not
        print("" if stream else result.fields.get("text", result.text))
    else:
        _say(result.error["message"])
    if out is not None:
        out.append(
            labeled_record(
                labeler,
                result,
                key=str(inputs[0]),
                task=task or "ask",
                prompt=question or result.prompt,
                sampling=result.sampling,
                path=inputs[0],
                logprobs=logprobs,
                extra={"images": [str(p) for p in inputs]} if len(inputs) > 1 else None,
            )
        )
    return 0 if result.ok else 1
