"""JSONL records (design: the JSONL record), appended and made durable one at a time."""

from __future__ import annotations

import hashlib
import json
import os
from datetime import datetime, timezone
from pathlib import Path
from typing import IO

SCHEMA = 1


def file_sha256(path: str | Path) -> str | None:
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    except OSError:
        return None
    return h.hexdigest()


def make_record(*, key: str, task: str, prompt: str, result, model: str, model_revision: str | None,
                sampling: dict, sha256: str | None = None, logprobs: bool = False, extra: dict | None = None) -> dict:
    """One record; `result` is a captioner.Result (ok or failed)."""
    first = result.images[0] if result.images else {}
    record = {
        "schema": SCHEMA, "key": key, "sha256": sha256, "width": first.get("width"), "height": first.get("height"),
        "task": task, "prompt": prompt, "text": result.text if result.ok else None,
        "status": "ok" if result.ok else "error", "error": result.error,
        "finish_reason": result.finish_reason, "num_input_tokens": result.num_input_tokens,
        "num_image_tokens": result.num_image_tokens, "num_output_tokens": result.num_output_tokens,
        "latency_ms": result.latency_ms, "model": model, "model_revision": model_revision,
        "sampling": sampling, "seed": sampling.get("seed"),
        "created_at": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
    }
    notes = [i["note"] for i in result.images if i.get("note")]
    if notes:
        record["note"] = "; ".join(notes)
    if logprobs:
        record["token_ids"] = result.token_ids
        record["logprobs"] = [round(x, 6) for x in result.logprobs]
    record.update(extra or {})
    return record


def append_record(stream: IO[str], record: dict) -> None:
    """Write one line, flush it, and fsync it when it is a real file, so a crash never loses it."""
    stream.write(json.dumps(record, ensure_ascii=False) + "\n")
    stream.flush()
    try:
        os.fsync(stream.fileno())
    except (OSError, ValueError, AttributeError):
        pass  # stdout, pipes and in-memory streams cannot be fsynced
