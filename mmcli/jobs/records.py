"""JSONL records (README: the JSONL record), appended and made durable one at a time."""

from __future__ import annotations

import contextlib
import json
import os
import stat
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, TYPE_CHECKING

from mmcli.errors import ConfigError, OutputError, OutputLocked
from mmcli.inputs.sources import ParquetCell, TarMember, container_file, file_facts

if TYPE_CHECKING:
    from mmcli.api.labeler import Labeler

# 2: tasks (the task name in `task`; `json`, `boxes`, `raw_text` where a task gives them)
SCHEMA = 2


def make_record(
    *,
    key: str,
    task: str,
    prompt: str,
    result,
    model: str,
    model_revision: str | None,
    sampling: dict,
    path: str | Path | None = None,
    logprobs: bool = False,
    extra: dict | None = None,
) -> dict:
    """One record; `result` is an api.result.Result (ok or failed), `path` the input file. The
    file's facts are those its worker took from the bytes it decoded; an input never decoded (a
    failure before) has them read here."""
    first = result.images[0] if result.images else {}
    where = container_file(Path(path) if isinstance(path, str) else path) if path else None
    record = {
        "schema": SCHEMA,
        "key": key,
        "path": os.path.abspath(where) if where is not None else None,
        **_within(path),
        **(first.get("file") or file_facts(where)),
        "width": first.get("width"),
        "height": first.get("height"),
        "task": task,
        "prompt": prompt,
        "text": result.text if result.ok else None,
        "status": "ok" if result.ok else "error",
        "error": result.error,
        "finish_reason": result.finish_reason,
        "num_input_tokens": result.num_input_tokens,
        "num_image_tokens": result.num_image_tokens,
        "num_output_tokens": result.num_output_tokens,
        "latency_ms": result.latency_ms,
        "model": model,
        "model_revision": model_revision,
        "sampling": sampling,
        "seed": sampling.get("seed"),
        "created_at": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
    }
    videos = [i["video"] for i in result.images if "video" in i]
    # duration, source fps, the sampled frames' times and their count (the first video's)
    if videos:
        record["video"] = videos[0]
    if result.reasoning is not None:
        record["reasoning"] = result.reasoning
    notes = [i["note"] for i in result.images if i.get("note")]
    if notes:
        record["note"] = "; ".join(notes)
    if logprobs:
        record["token_ids"] = result.token_ids
        record["logprobs"] = [round(x, 6) for x in result.logprobs]
    if result.ok:
        record.update(result.fields)
    record.update(extra or {})
    return record


def labeled_record(
    labeler: Labeler, result, *, sampling: dict, extra: dict | None = None, **fields
) -> dict:
    """The record of a Labeler's result (caption's, ask's, a Ray actor's): make_record's, with the
    model, the precision and the kernels of the run that made it."""
    return make_record(
        result=result,
        model=labeler.model_name,
        model_revision=labeler.revision,
        sampling=sampling,
        extra={
            "precision": labeler.precision.record(),
            "kernels": labeler.kernel_plan.record(),
            **(extra or {}),
        },
        **fields,
    )


def _within(source) -> dict:
    """Where in its file a shard sample or a Parquet row is."""
    if isinstance(source, TarMember):
        return {"member": source.name}
    if isinstance(source, ParquetCell):
        return {"row": [source.row_group, source.row]}
    return {}


def append_record(stream: IO[str], record: dict) -> None:
    """Write one line to a stream (stdout, a pipe) and flush it; a regular file is fsynced too,
    and a failing fsync there is an error (an EIO must not go unnoticed)."""
    stream.write(json.dumps(record, ensure_ascii=False) + "\n")
    stream.flush()
    try:
        fd = stream.fileno()
    except (OSError, ValueError, AttributeError):
        return  # an in-memory stream
    if stat.S_ISREG(os.fstat(fd).st_mode):
        os.fsync(fd)


class JsonlOutput:
    """An output JSONL file owned by one run: an exclusive lock, a torn last line set aside,
    appends fsynced."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.lock_path = self.path.with_name(self.path.name + ".lock")
        self._lock = None
        self._file = None
        self.set_aside: Path | None = None

    def open(self) -> JsonlOutput:
        try:
            return self._open()
        except OSError as e:
            self.close()
            raise OutputError(f"{self.path}: cannot write ({e.strerror or e})") from None

    def _open(self) -> JsonlOutput:
        import fcntl

        self.path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(self.lock_path, "a+")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            other = lock.read().strip() or "?"
            lock.close()
            raise OutputLocked(
                f"{self.path}: another mmcli run (pid {other}) is writing this output; wait for "
                "it or choose another -o"
            ) from None
        lock.seek(0)
        lock.truncate()
        lock.write(str(os.getpid()))
        lock.flush()
        self._lock = lock
        self._repair_torn_tail()
        # unbuffered: a failed write leaves nothing queued
        self._file = open(self.path, "ab", buffering=0)
        return self

    def _repair_torn_tail(self) -> None:
        """A crash mid-write can leave a last line without its newline: move it to a side file,
        never merge it."""
        if not self.path.exists():
            return
        with open(self.path, "rb+") as f:
            size = f.seek(0, os.SEEK_END)
            if size == 0:
                return
            f.seek(size - 1)
            if f.read(1) == b"\n":
                return
            start = size
            while start > 0:
                step = min(65536, start)
                f.seek(start - step)
                chunk = f.read(step)
                cut = chunk.rfind(b"\n")
                if cut >= 0:
                    start = start - step + cut + 1
                    break
                start -= step
            f.seek(start)
            torn = f.read()
            stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
            self.set_aside = self.path.with_name(f"{self.path.name}.torn-{stamp}")
            with open(self.set_aside, "wb") as side:  # durable before the output loses the line
                side.write(torn)
                side.flush()
                os.fsync(side.fileno())
            f.truncate(start)
            f.flush()
            os.fsync(f.fileno())

    def records(self):
        """Records already in the file (lines that do not parse are skipped)."""
        if not self.path.exists():
            return
        with open(self.path, encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    yield json.loads(line)
                except ValueError:
                    continue

    def append(self, record: dict) -> None:
        """One whole line, fsynced; on a write error (a full disk, EIO) the partial line is cut
        off again and OutputError names the file and the cause."""
        data = (json.dumps(record, ensure_ascii=False) + "\n").encode()
        fd = self._file.fileno()
        start = os.lseek(fd, 0, os.SEEK_END)
        try:
            written = 0
            while written < len(data):
                written += os.write(fd, data[written:])
            os.fsync(fd)
        except OSError as e:
            with contextlib.suppress(OSError):
                # whole records only; if even this fails, the next run sets the tail aside
                os.ftruncate(fd, start)
            raise OutputError(
                f"{self.path}: cannot write ({e.strerror or e}); the records before this one are "
                "kept, and a rerun continues from them"
            ) from None

    def close(self) -> None:
        if self._file:
            self._file.close()
        if self._lock:
            self._lock.close()  # releases the flock
        self._file = self._lock = None


def sidecar_path(image: Path, ext: str) -> Path:
    return image.with_suffix(ext)


def write_sidecar(image: Path, ext: str, text: str) -> Path:
    """The caption next to the image (see `write_text_whole`); returns the sidecar's path."""
    target = sidecar_path(image, ext)
    write_text_whole(target, text)
    return target


def write_text_whole(target: Path, text: str) -> None:
    """`text` and a newline, written whole through a temporary file, fsync and a rename; a failure
    is OutputError naming the file."""
    # its own name per call: the review server's threads share a pid
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise OutputError(f"{target}: cannot write the sidecar ({e.strerror or e})") from None


def read_records(path: Path) -> list[dict]:
    """Every record of a JSONL file; a line that is not a JSON record is refused by number."""
    records = []
    try:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                try:
                    record = json.loads(line)
                except ValueError:
                    record = None
                if not isinstance(record, dict) or "key" not in record:
                    raise ConfigError(f"{path}:{number}: not a JSON record")
                records.append(record)
    except OSError as e:
        raise ConfigError(f"{path}: cannot read ({e.strerror or e})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text") from None
    return records


def current_records(files: list[Path]) -> list[dict]:
    """The current record of each (key, task) over the files (a later line wins), in the order
    the pairs first appear."""
    current: dict[tuple, dict] = {}
    for file in files:
        for record in read_records(Path(file)):
            current[(record["key"], record.get("task") or "")] = record
    return list(current.values())
