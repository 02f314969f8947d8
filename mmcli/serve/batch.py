"""`mmcli batch`: an OpenAI Batch API input file (lines of custom_id, method, url, body) run offline
through the same engine and rules as `serve`, each answer a line of the Batch API's output format
appended through the locked, fsynced writer. The file is read as a stream, twice: once to refuse
a repeated custom_id before the model loads (only the ids are kept), once to run it, a bounded
window of lines in flight. A rerun skips the custom_ids already answered; a bad line, and any
failure of one, is that line's error."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import ValidationError

from mmcli.errors import ConfigError, OutputError
from mmcli.serve.chat import Limits, build_job, response_of
from mmcli.serve.media import MediaPolicy
from mmcli.serve.protocol import APIError, ChatCompletionRequest

if TYPE_CHECKING:
    from mmcli.api.labeler import Labeler

URL = "/v1/chat/completions"


@dataclass
class BatchLine:
    number: int  # 1-based, as an editor shows it
    custom_id: str | None
    body: ChatCompletionRequest | None = None
    error: str | None = None  # why the line cannot run


@dataclass
class BatchScan:
    """What the first pass over a batch file found: the lines still to answer, and how many of
    them are requests the model must answer."""

    todo: int = 0
    runnable: int = 0


def batch_lines(path: Path):
    """The file's non-empty lines, parsed one at a time; ConfigError when it cannot be read."""
    try:
        with open(path, encoding="utf-8") as f:
            for number, raw in enumerate(f, 1):
                if raw.strip():
                    yield parse_line(number, raw)
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read ({e})") from None


def scan_batch(path: Path, answered: Answered) -> BatchScan:
    """One pass over the file, keeping only its custom_ids: ConfigError for one given twice."""
    seen, scan = {}, BatchScan()
    for line in batch_lines(path):
        if line.custom_id in seen:
            raise ConfigError(
                f"{path}: custom_id {line.custom_id!r} is on line "
                f"{seen[line.custom_id]} and line {line.number}; each must be unique"
            )
        if line.custom_id is not None:
            seen[line.custom_id] = line.number
        if answered.wants(line):
            scan.todo += 1
            scan.runnable += line.body is not None
    return scan


@dataclass
class Answered:
    """What an output file already holds: the custom_ids answered (status 200), and the lines
    that are no request already reported."""

    ids: set = field(default_factory=set)
    reported: set = field(default_factory=set)

    @classmethod
    def of(cls, records) -> Answered:
        done = cls()
        for r in records:
            if not isinstance(r, dict):
                continue
            if not r.get("custom_id"):
                done.reported.add(r.get("id"))
            elif (r.get("response") or {}).get("status_code") == 200:
                done.ids.add(r["custom_id"])
        return done

    def wants(self, line: BatchLine) -> bool:
        """The line has no answer yet (an answer that is an error is redone); a line that is
        no request (no custom_id) is reported once."""
        if line.custom_id is not None:
            return line.custom_id not in self.ids
        return f"batch_req_{line.number:06d}" not in self.reported


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


async def run_lines(
    labeler: Labeler, service, lines, policy: MediaPolicy, write, window: int
) -> None:
    """The lines through the engine (it batches them), at most `window` in flight, each written
    as it finishes; whatever fails a line is that line's answer."""
    loop = asyncio.get_running_loop()
    limits = Limits(max_images=labeler.config.engine.max_seqs * 16, max_queue=1 << 30)
    room, running = asyncio.Semaphore(window), set()

    async def one(line: BatchLine) -> None:
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
        except OutputError:  # the output cannot be written: the run stops (exit 3)
            raise
        except Exception as e:  # noqa: BLE001 - one line's failure, whatever it is, is its own
            write(line, 500, APIError(500, f"{type(e).__name__}: {e}").body())
        finally:
            room.release()

    for line in lines:
        if line.body is None:
            write(line, None, None)
            continue
        await room.acquire()
        task = asyncio.create_task(one(line))
        running.add(task)
        task.add_done_callback(running.discard)
    await asyncio.gather(*running)


async def _finished(handle):
    while True:
        kind, value = await handle.events.get()
        if kind == "done":
            return value
        if kind == "error":
            raise APIError(500, value)
