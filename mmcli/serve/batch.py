"""`mmcli batch`: an OpenAI Batch API input file (lines of custom_id, method, url, body) run offline
through the same engine and rules as `serve`, each answer a line of the Batch API's output format
appended through the locked, fsynced writer. A rerun skips the custom_ids already answered; a bad
line is that line's error; a repeated custom_id is refused before the model loads."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from mmcli.errors import ConfigError
from mmcli.serve.chat import Limits, build_job, response_of
from mmcli.serve.media import MediaPolicy
from mmcli.serve.protocol import APIError, ChatCompletionRequest

URL = "/v1/chat/completions"


@dataclass
class BatchLine:
    number: int  # 1-based, as an editor shows it
    custom_id: str | None
    body: ChatCompletionRequest | None = None
    error: str | None = None  # why the line cannot run


def read_batch(path: Path) -> list[BatchLine]:
    """Every non-empty line, parsed and checked; ConfigError for a custom_id given twice."""
    lines, seen = [], {}
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read ({e})") from None
    for number, raw in enumerate(text.splitlines(), 1):
        if raw.strip():
            line = parse_line(number, raw)
            if line.custom_id in seen:
                raise ConfigError(
                    f"{path}: custom_id {line.custom_id!r} is on line "
                    f"{seen[line.custom_id]} and line {number}; each must be unique"
                )
            if line.custom_id is not None:
                seen[line.custom_id] = number
            lines.append(line)
    return lines


def parse_line(number: int, raw: str) -> BatchLine:
    try:
        entry = json.loads(raw)
    except ValueError as e:
        return BatchLine(number, None, error=f"line {number}: not JSON ({e})")
    if not isinstance(entry, dict) or not isinstance(entry.get("custom_id"), str):
        return BatchLine(number, None, error=f"line {number}: no custom_id string")
    line = BatchLine(number, entry["custom_id"])
    if entry.get("method", "POST") != "POST" or entry.get("url") != URL:
        line.error = f"line {number}: method POST and url {URL} are what mmcli batch runs"
        return line
    try:
        line.body = ChatCompletionRequest.model_validate(entry.get("body"))
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        line.error = f"line {number}: body.{where}: {first['msg']}"
    return line


def output_line(line: BatchLine, status: int | None, body: dict | None) -> dict:
    """The Batch API's output line: the response (its status and body, errors in OpenAI's shape
    included), or `error` for a line that is no request."""
    response = None
    if status is not None:
        response = {
            "status_code": status,
            "request_id": body.get("id") or f"batch-{line.number}",
            "body": body,
        }
    error = None if status is not None else {"code": "invalid_request", "message": line.error}
    return {
        "id": f"batch_req_{line.number:06d}",
        "custom_id": line.custom_id,
        "response": response,
        "error": error,
    }


async def run_lines(labeler, service, lines: list[BatchLine], policy: MediaPolicy, write) -> None:
    """Every line through the engine at once (it batches them), each written as it finishes."""
    loop = asyncio.get_running_loop()
    limits = Limits(max_images=labeler.config.engine.max_seqs * 16, max_queue=1 << 30)

    async def one(line: BatchLine) -> None:
        if line.body is None:
            return write(line, None, None)
        try:
            key = f"batch-{line.number}"
            job = await asyncio.to_thread(
                build_job, labeler, line.body, policy, limits, key, labeler.config.model
            )
            handles = service.submit(job.requests, loop)
            finished = [await _finished(handle) for handle in handles]
            write(line, 200, response_of(labeler, job, finished))
        except APIError as e:
            write(line, e.status, e.body())

    await asyncio.gather(*(one(line) for line in lines))


async def _finished(handle):
    while True:
        kind, value = await handle.events.get()
        if kind == "done":
            return value
        if kind == "error":
            raise APIError(500, value)
