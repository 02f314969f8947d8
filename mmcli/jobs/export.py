"""`mmcli export`: the current record of each (key, task) out of the JSONL log, as Parquet (one row
per label, or per input with --wide) or as a Hugging Face imagefolder's metadata.jsonl.

The JSONL stays the crash-safe log and the resume source; an export is made from it, whole, and
written aside then renamed, so a reader never sees half a file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from mmcli.errors import ConfigError
from mmcli.jobs.records import current_records, write_text_whole

FORMATS = ("parquet", "imagefolder", "webdataset")
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff")


def export(
    files: list[Path],
    to: str,
    out: Path,
    wide: bool = False,
    include_errors: bool = False,
    with_media: bool = False,
) -> int:
    """Write the export; returns how many rows (Parquet) or images (imagefolder) it holds."""
    if to not in FORMATS:
        raise ConfigError(f"--to {to!r}: must be one of {', '.join(FORMATS)}")
    everything = current_records(files)
    if to == "webdataset":
        return write_webdataset(everything, out, with_media)
    records = [r for r in everything if include_errors or r.get("status") == "ok"]
    if to == "imagefolder":
        return write_imagefolder(records, out)
    rows = wide_rows(records) if wide else [long_row(r) for r in records]
    write_parquet(rows, out, wide)
    return len(rows)


def long_row(record: dict) -> dict:
    """One label as typed columns (JSON values as JSON text; boxes as a list of structs)."""

    def as_json(value):
        return None if value is None else json.dumps(value, ensure_ascii=False)

    return {
        "key": record["key"],
        "task": record.get("task") or "",
        "path": record.get("path"),
        "text": record.get("text"),
        "json": as_json(record.get("json")) if "json" in record else None,
        "boxes": record.get("boxes"),
        "status": record.get("status"),
        "error": (record.get("error") or {}).get("message"),
        "finish_reason": record.get("finish_reason"),
        "num_input_tokens": record.get("num_input_tokens"),
        "num_output_tokens": record.get("num_output_tokens"),
        "width": record.get("width"),
        "height": record.get("height"),
        "precision": as_json(record.get("precision")),
        "model": record.get("model"),
        "settings": record.get("settings"),
        "review": as_json(record.get("review")),
    }


def wide_rows(records: list[dict]) -> list[dict]:
    """One row per input: its key and path, then per task its text (and `TASK_json`,
    `TASK_boxes` where the task gives them, and `TASK_status`)."""
    rows: dict[str, dict] = {}
    for record in records:
        label = long_row(record)
        row = rows.setdefault(label["key"], {"key": label["key"], "path": label["path"]})
        task = label["task"] or "answer"
        row[task], row[f"{task}_status"] = label["text"], label["status"]
        if label["json"] is not None:
            row[f"{task}_json"] = label["json"]
        if label["boxes"] is not None:
            row[f"{task}_boxes"] = label["boxes"]
    return list(rows.values())


def write_parquet(rows: list[dict], out: Path, wide: bool) -> None:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError("--to parquet needs pyarrow: pip install 'mmcli[parquet]'") from None
    columns = sorted({name for row in rows for name in row}, key=_column_order)
    box = pa.struct([("label", pa.string()), ("bbox", pa.list_(pa.float64()))])
    schema = pa.schema([(name, _column_type(name, pa, box)) for name in columns])
    table = pa.Table.from_pylist(rows, schema=schema)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        pq.write_table(table, tmp)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)


def _column_type(name: str, pa, box):
    if name == "boxes" or name.endswith("_boxes"):
        return pa.list_(box)
    if name.startswith("num_") or name in ("width", "height"):
        return pa.int64()
    return pa.string()


def _column_order(name: str) -> tuple:
    first = ("key", "task", "path", "text")
    return (first.index(name), name) if name in first else (len(first), name)


def write_imagefolder(records: list[dict], data_dir: Path) -> int:
    """`metadata.jsonl` in `data_dir`, beside the images: `file_name` (relative to it) and one
    column per task, so that `datasets.load_dataset("imagefolder", data_dir=...)` loads images and
    labels together. Records of files outside `data_dir`, or of videos, are left out."""
    root = Path(os.path.realpath(data_dir))
    if not root.is_dir():
        raise ConfigError(f"{data_dir}: no such folder (imagefolder writes beside the images)")
    rows: dict[str, dict] = {}
    for record in records:
        path = Path(os.path.realpath(record.get("path") or ""))
        if path.suffix.lower() not in IMAGE_SUFFIXES or root not in path.parents:
            continue
        name = path.relative_to(root).as_posix()
        row = rows.setdefault(name, {"file_name": name})
        task = record.get("task") or "answer"
        row[task] = record.get("text")
        if "json" in record:
            row[f"{task}_json"] = json.dumps(record["json"], ensure_ascii=False)
    if not rows:
        raise ConfigError(f"{data_dir}: none of the records names an image inside it")
    columns = sorted({c for row in rows.values() for c in row}, key=lambda c: (c != "file_name", c))
    lines = [
        json.dumps({c: row.get(c) for c in columns}, ensure_ascii=False) for row in rows.values()
    ]
    write_text_whole(root / "metadata.jsonl", "\n".join(lines))
    return len(rows)


def write_webdataset(records: list[dict], out: Path, with_media: bool) -> int:
    """Per input shard, a shard of the same name in `out` holding `SAMPLE.TASK.txt` (and
    `SAMPLE.TASK.json` for JSON and boxes answers) for each ok label, in the input's sample order
    so that webdataset readers can pair them; with `with_media`, every original member byte for
    byte, each sample's labels after its own members. And `SHARD_stats.json` per shard: samples,
    ok, failed, errors by cause, seconds. Returns how many shards were written."""
    shards: dict[str, list[dict]] = {}
    for record in records:
        if record.get("member") is not None or str(record.get("key", "")).endswith("/#damaged"):
            shards.setdefault(record["path"], []).append(record)
    if not shards:
        raise ConfigError("no record comes from a tar shard (--to webdataset writes beside shards)")
    out.mkdir(parents=True, exist_ok=True)
    for shard, shard_records in shards.items():
        target = out / Path(shard).name
        if target.resolve() == Path(shard).resolve():
            raise ConfigError(f"{target}: is the input shard itself; choose another folder")
        _write_tar(target, Path(shard) if with_media else None, _label_members(shard_records))
        stats = json.dumps(shard_stats(shard_records), indent=1)
        write_text_whole(out / f"{Path(shard).stem}_stats.json", stats)
    return len(shards)


def _label_members(records: list[dict]) -> dict[str, list[tuple[str, bytes]]]:
    """Per sample (its name inside the shard): its label members, SAMPLE.TASK.txt and .json."""
    members: dict[str, list[tuple[str, bytes]]] = {}
    for record in records:
        if record.get("status") != "ok" or record.get("member") is None:
            continue
        name = _sample_name(record["member"])
        task = record.get("task") or "answer"
        entry = members.setdefault(name, [])
        entry.append((f"{name}.{task}.txt", (record.get("text") or "").encode()))
        value = record.get("json", record.get("boxes"))
        if value is not None:
            entry.append((f"{name}.{task}.json", json.dumps(value, ensure_ascii=False).encode()))
    return members


def _sample_name(member: str) -> str:
    """A member's sample: its name up to the first dot of its base name (webdataset's grouping)."""
    folder, _, base = member.rpartition("/")
    return f"{folder}/{base.split('.')[0]}" if folder else base.split(".")[0]


def _write_tar(target: Path, source: Path | None, labels: dict) -> None:
    """The label shard (with the source's members first, sample by sample, when given), written
    aside and renamed."""
    import tarfile

    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        with tarfile.open(tmp, "w", format=tarfile.USTAR_FORMAT) as tar:
            if source is not None:
                _copy_with_labels(source, tar, labels)
            for members in labels.values():  # what is left: samples without media members
                _add_members(tar, members)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def _copy_with_labels(source: Path, tar, labels: dict) -> None:
    """Every member of `source` byte for byte, each sample's labels after its last member."""
    import tarfile

    current = None
    with tarfile.open(source, "r:") as original:
        for info in original:
            sample = _sample_name(info.name)
            if current is not None and sample != current:
                _add_members(tar, labels.pop(current, []))
            current = sample
            tar.addfile(info, original.extractfile(info) if info.isfile() else None)
    if current is not None:
        _add_members(tar, labels.pop(current, []))


def _add_members(tar, members: list[tuple[str, bytes]]) -> None:
    import io
    import tarfile

    for name, data in members:
        info = tarfile.TarInfo(name)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))


def shard_stats(records: list[dict]) -> dict:
    """img2dataset-like counts for one shard's labels: samples, ok, failed, errors by cause."""
    samples = {r["key"] for r in records if not str(r["key"]).endswith("/#damaged")}
    failed = [r for r in records if r.get("status") == "error"]
    causes: dict[str, int] = {}
    for record in failed:
        message = (record.get("error") or {}).get("message") or "error"
        cause = message.rsplit(": ", 1)[-1][:80]
        causes[cause] = causes.get(cause, 0) + 1
    return {
        "samples": len(samples),
        "labels": len(records),
        "ok": sum(r.get("status") == "ok" for r in records),
        "failed": len(failed),
        "errors": causes,
        "seconds": round(sum(r.get("latency_ms") or 0 for r in records) / 1000, 3),
    }
