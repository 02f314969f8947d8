"""`mmcli batch REQUESTS.jsonl -o RESULTS.jsonl`: an OpenAI Batch API file run offline, resumable,
with caption's progress and summary."""

from __future__ import annotations

import asyncio
from pathlib import Path

from mmcli.config import Config


def run_batch(cfg: Config, requests: Path, output: Path, progress) -> int:
    """Returns the exit code: 0, 1 when a line failed, 130 interrupted."""
    from mmcli.jobs.records import JsonlOutput
    from mmcli.serve.batch import Answered, batch_lines, output_line, scan_batch

    out = JsonlOutput(output).open()
    try:
        answered = Answered.of(out.records())
        scan = scan_batch(requests, answered)  # a repeated custom_id: refused before loading
        progress.total = scan.todo
        if not scan.todo:
            progress.say(f"{output}: every custom_id of {requests} is answered")
            return 0

        def write(line, status, body) -> None:
            out.append(output_line(line, status, body))
            progress.update(progress_record(line, status, body))

        todo = (line for line in batch_lines(requests) if answered.wants(line))
        if not scan.runnable:  # no model needed for these
            for line in todo:
                write(line, None, None)
            progress.finish()
            return 1 if progress.failed else 0
        return _answer(cfg, requests, todo, write, progress)
    finally:
        out.close()


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


def _answer(cfg: Config, requests: Path, todo, write, progress) -> int:
    from mmcli.api.labeler import Labeler
    from mmcli.api.loader import load_description, resolve_run
    from mmcli.inputs.prefetch import default_workers
    from mmcli.serve.batch import run_lines
    from mmcli.serve.media import MediaPolicy
    from mmcli.serve.service import EngineService

    run = resolve_run(cfg)
    with progress.loading(load_description(run)) as loaded:
        labeler = Labeler.from_run(run)
        loaded["kernels"] = labeler.kernels
    service = EngineService(labeler, max_queue=1 << 30).start()
    policy = MediaPolicy(allowed_dir=requests.resolve().parent)
    # as caption's inputs ahead: the engine's next wave prepared while this one runs
    seqs = labeler.config.engine.max_seqs  # as the run resolved it
    window = max(seqs, cfg.vision.lookahead) + default_workers(cfg.inputs.workers)
    try:
        asyncio.run(run_lines(labeler, service, todo, policy, write, window))
        progress.finish()
        return 1 if progress.failed else 0
    except KeyboardInterrupt:
        progress.finish(interrupted=True)
        return 130
    finally:
        service.close()
