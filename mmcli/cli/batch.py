"""`mmcli batch REQUESTS.jsonl -o RESULTS.jsonl`: an OpenAI Batch API file run offline, resumable,
with caption's progress and summary."""

from __future__ import annotations

import asyncio
from pathlib import Path

from mmcli.config import Config


def run_batch(cfg: Config, requests: Path, output: Path, progress) -> int:
    """Returns the exit code: 0, 1 when a line failed, 130 interrupted."""
    from mmcli.jobs.records import JsonlOutput
    from mmcli.serve.batch import output_line, read_batch

    lines = read_batch(requests)  # a repeated custom_id: refused here, before loading
    out = JsonlOutput(output).open()
    try:
        todo = still_to_answer(lines, list(out.records()))
        progress.total = len(todo)
        if not todo:
            progress.say(f"{output}: every custom_id of {requests} is answered")
            return 0

        def write(line, status, body) -> None:
            out.append(output_line(line, status, body))
            progress.update(progress_record(line, status, body))

        for line in [line for line in todo if line.body is None]:  # no model needed for these
            write(line, None, None)
        runnable = [line for line in todo if line.body is not None]
        if not runnable:
            progress.finish()
            return 1 if progress.failed else 0
        return _answer(cfg, requests, runnable, write, progress)
    finally:
        out.close()


def still_to_answer(lines: list, records: list) -> list:
    """The lines whose request has no answer yet (an answer that is an error is redone); a line
    that is no request (no custom_id) is reported once."""
    answered = {
        r.get("custom_id")
        for r in records
        if isinstance(r, dict) and (r.get("response") or {}).get("status_code") == 200
    }
    reported = {r.get("id") for r in records if isinstance(r, dict) and not r.get("custom_id")}
    return [
        line
        for line in lines
        if (line.custom_id is not None and line.custom_id not in answered)
        or (line.custom_id is None and f"batch_req_{line.number:06d}" not in reported)
    ]


def progress_record(line, status: int | None, body: dict | None) -> dict:
    """What the progress line and summary read of an answered line."""
    if status == 200:
        tokens = body["usage"]["completion_tokens"]
        return {"key": line.custom_id, "status": "ok", "num_output_tokens": tokens}
    message = body["error"]["message"] if body is not None else line.error
    return {
        "key": line.custom_id or f"line {line.number}",
        "status": "error",
        "error": {"message": message},
    }


def _answer(cfg: Config, requests: Path, todo: list, write, progress) -> int:
    from mmcli.api.labeler import Labeler
    from mmcli.api.loader import load_description, resolve_run
    from mmcli.serve.batch import run_lines
    from mmcli.serve.media import MediaPolicy
    from mmcli.serve.service import EngineService

    run = resolve_run(cfg)
    with progress.loading(load_description(run)) as loaded:
        labeler = Labeler.from_run(run)
        loaded["kernels"] = labeler.kernels
    service = EngineService(labeler, max_queue=1 << 30).start()
    policy = MediaPolicy(allowed_dir=requests.resolve().parent)
    try:
        asyncio.run(run_lines(labeler, service, todo, policy, write))
        progress.finish()
        return 1 if progress.failed else 0
    except KeyboardInterrupt:
        progress.finish(interrupted=True)
        return 130
    finally:
        service.close()
