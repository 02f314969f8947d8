"""The labels under review: the records of one or more JSONL files, the latest per (key, task),
grouped per input, filtered and sorted for the page; a person's change appended as a new record."""

from __future__ import annotations

import copy
import json
import math
import os
import re
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from mmcli.config import ScanConfig
from mmcli.errors import MmcliError, OutputLocked
from mmcli.inputs.datasets import dataset_items, is_dataset_file
from mmcli.inputs.sources import ParquetCell, Source, TarMember
from mmcli.jobs.records import JsonlOutput, read_records, write_text_whole

ACTIONS = ("edit", "approve", "reject", "delete_box")
SORTS = ("key", "confidence", "latency")


@dataclass
class Item:
    """One input (an image or a video) and the latest record of each of its tasks."""

    key: str
    labels: dict[str, dict] = field(default_factory=dict)  # task -> latest record
    sources: dict[str, Path] = field(default_factory=dict)  # task -> the file it came from

    @property
    def record(self) -> dict:
        return next(iter(self.labels.values()))

    def confidence(self) -> float:
        """Mean token log-probability over its tasks' answers (-inf without logprobs)."""
        values = [lp for r in self.labels.values() for lp in r.get("logprobs") or []]
        return sum(values) / len(values) if values else -math.inf

    def latency(self) -> int:
        return sum(r.get("latency_ms") or 0 for r in self.labels.values())


def input_root(record: dict) -> str | None:
    """The folder a record's file was labeled under: its path less its key (a file given alone:
    its folder)."""
    path, key = record.get("path"), str(record.get("key", ""))
    if not path:
        return None
    if key and path.endswith(os.sep + key) and len(path) > len(key) + 1:
        return path[: -len(key) - 1]
    return os.path.dirname(path)


class ReviewStore:
    def __init__(self, files: list[Path]):
        self.files = [Path(f) for f in files]
        self.lock = threading.Lock()
        self.items: list[Item] = []
        self.index: dict[str, int] = {}
        roots: set[str] = set()
        for file in self.files:
            for record in read_records(file):
                self._add(record, file)
                roots.add(input_root(record) or "")
        self.roots = {os.path.realpath(root) for root in roots if root}
        self.listings: dict[str, dict] = {}  # a shard's or Parquet file's inputs, once listed
        self.tasks = sorted({t for item in self.items for t in item.labels})

    def _add(self, record: dict, source: Path) -> None:
        key = str(record["key"])
        if key not in self.index:
            self.index[key] = len(self.items)
            self.items.append(Item(key))
        item = self.items[self.index[key]]
        task = record.get("task") or ""
        item.labels[task] = record  # a later line is the current one
        item.sources[task] = source

    def media_path(self, item: Item) -> Path | None:
        """The item's file, if it lies inside the labeled roots (a symlink out of them is not)."""
        path = item.record.get("path")
        if not path:
            return None
        real = os.path.realpath(path)
        if not any(real.startswith(root.rstrip(os.sep) + os.sep) for root in self.roots):
            return None
        return Path(real)

    def media_source(self, item: Item) -> Source | None:
        """Where the item's image or video is: its file, or its member of a shard or row of a
        Parquet file (found by listing that file once), if inside the labeled roots."""
        path = self.media_path(item)
        record = item.record
        if path is None or ("member" not in record and "row" not in record):
            return path
        if str(path) not in self.listings:
            media = ScanConfig().extensions + ScanConfig().video_extensions
            try:
                listed = dataset_items(path, media, (None, None)) if is_dataset_file(path) else []
            except MmcliError:  # a Parquet file whose image column is not found: shown as missing
                listed = []
            self.listings[str(path)] = {_where(source): source for _, source in listed}
        where = record.get("member") or tuple(record.get("row") or ())
        return self.listings[str(path)].get(where)

    def query(
        self,
        task: str = "",
        status: str = "",
        text: str = "",
        regex: bool = False,
        sort: str = "key",
    ) -> tuple[list[int], dict[str, int]]:
        """Ids of the items that match, in order, and the matches counted by status."""
        if sort not in SORTS:
            raise ValueError(f"sort must be one of {', '.join(SORTS)}")
        pattern = re.compile(text, re.I) if regex and text else None
        needle = text.lower()
        found, counts = [], {"ok": 0, "error": 0}
        for n, item in enumerate(self.items):
            if task and task not in item.labels:
                continue
            labels = [item.labels[task]] if task else list(item.labels.values())
            if status and not any(_status(r) == status for r in labels):
                continue
            if text and not any(_matches(r, needle, pattern) for r in labels):
                continue
            found.append(n)
            worst = "error" if any(r.get("status") == "error" for r in labels) else "ok"
            counts[worst] += 1
        if sort == "confidence":
            found.sort(key=lambda n: self.items[n].confidence())
        elif sort == "latency":
            found.sort(key=lambda n: -self.items[n].latency())
        return found, counts

    def review(self, item_id: int, task: str, action: str, value=None) -> dict:
        """Append a person's change of one label as a new record (locked, fsynced) and keep it
        as the current one; an edited label's sidecar is rewritten to the new text."""
        if action not in ACTIONS:
            raise ValueError(f"action must be one of {', '.join(ACTIONS)}")
        with self.lock:
            item = self.items[item_id]
            if task not in item.labels:
                raise KeyError(f"{item.key} has no task {task!r}")
            record = _changed(item.labels[task], action, value)
            out = _open_waiting(item.sources[task])
            try:
                out.append(record)
            finally:
                out.close()
            item.labels[task] = record
            if action == "edit" and record.get("sidecar") and record.get("text") is not None:
                write_text_whole(Path(record["sidecar"]), record["text"])
        return record


def _open_waiting(path: Path, seconds: float = 5.0) -> JsonlOutput:
    """The record file, locked: another reviewer's append is waited for; a run that holds the
    file for longer makes the change fail with its message."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            return JsonlOutput(path).open()
        except OutputLocked:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def _changed(record: dict, action: str, value) -> dict:
    """The record as a person left it: the new text (or JSON, or boxes less one), or a verdict."""
    new = copy.deepcopy(record)
    previous = record.get("review") or {}
    verdict = {"approve": "approved", "reject": "rejected"}.get(action, previous.get("verdict"))
    if action == "edit" and "json" in record and not isinstance(value, str):
        new["json"], new["text"] = value, json.dumps(value, ensure_ascii=False)
    elif action == "edit":
        new["text"] = str(value)
        verdict = None
    elif action == "delete_box":
        boxes = list(record.get("boxes") or [])
        del boxes[int(value)]
        new["boxes"] = boxes
    now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    new["review"] = {"action": action, "verdict": verdict, "by": "person", "at": now}
    new["created_at"] = now
    return new


def _where(source) -> str | tuple:
    if isinstance(source, TarMember):
        return source.name
    if isinstance(source, ParquetCell):
        return (source.row_group, source.row)
    return ""


def _status(record: dict) -> str:
    return "error" if record.get("status") == "error" else "ok"


def _matches(record: dict, needle: str, pattern) -> bool:
    text = record.get("text") or (record.get("error") or {}).get("message") or ""
    return bool(pattern.search(text)) if pattern is not None else needle in text.lower()
