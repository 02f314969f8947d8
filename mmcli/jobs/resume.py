"""What makes a recorded label current: the settings it was made under (hashed into the record's
`settings`), and the image file it was made from (size and mtime, confirmed by sha256).

The settings cover everything that changes a label: the record schema, the model's identity (the
hub revision, or a digest of a local checkpoint's config.json and its weight files' headers,
sizes and modification times), the weights' and the computation's precision, the pixel budget,
the prompt and the sampling."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import struct

from mmcli.api.loader import Run
from mmcli.config import Config
from mmcli.inputs.sources import Source, checked_sha256, container_file
from mmcli.jobs.records import SCHEMA
from mmcli.tasks import Task
from mmcli.weights.hub import snapshot_revision


def model_identity(run: Run) -> str:
    """The hub revision of a snapshot, else a digest of config.json (as the run read it) and
    every weight file's safetensors header, size and mtime (a changed weight file changes it;
    reading every weight byte would cost seconds per run)."""
    path = run.path
    if path is None:
        return f"{run.config.model}@not-downloaded"
    revision = snapshot_revision(path)
    if revision is not None:
        return f"revision {revision}"
    digest = hashlib.sha256()
    digest.update(b"config.json\0" + run.config_bytes)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        digest.update(index.name.encode() + b"\0" + index.read_bytes())
    for weights in sorted(path.glob("*.safetensors")):
        stat = weights.stat()
        digest.update(f"{weights.name}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
        with open(weights, "rb") as f:
            header = f.read(8)
            if len(header) == 8:
                digest.update(f.read(min(struct.unpack("<Q", header)[0], 100 << 20)))
    return f"digest {digest.hexdigest()[:20]}"


def label_settings(run: Run) -> dict:
    """What every label of a run depends on, as a JSON-able dict. A task's own part (its prompt,
    sampling, output) and the video settings (for videos alone) are added per record by
    `task_resume_keys`."""
    cfg, precision, image = run.config, run.precision, run.image_cfg
    settings = {
        "schema": SCHEMA,
        "model": model_identity(run),
        "weights_dtype": precision.weights,
        "compute_dtype": precision.compute,
        "quantize": cfg.quantize,
        "pixels": [image.min_pixels, image.max_pixels],
    }
    if cfg.thinking:  # only when on: labels made before the setting existed keep their keys
        settings["thinking"] = True
    return settings


def task_resume_keys(cfg: Config, base: dict, task: Task) -> dict[str, str]:
    """A task's resume keys: one for images, one for videos (with the video settings), and the
    key records made before keys were split so (accepted as current when it still matches)."""
    video = dataclasses.asdict(cfg.video)
    legacy = {**base, "prompt": cfg.prompt, "video": video, "sampling": cfg.generation.as_dict()}
    return {
        "image": settings_hash({**base, "task": task.definition}),
        "video": settings_hash({**base, "video": video, "task": task.definition}),
        "legacy": settings_hash({**legacy, "task": task.definition}),
    }


def settings_hash(settings: dict) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def file_changed(source: Source, record: dict) -> bool:
    """The input's file (a shard or Parquet file for their samples) differs from the one the
    record was made from: size or mtime differ, and so does the sha256 (hashed once a file)."""
    path = container_file(source)
    try:
        stat = path.stat()
    except OSError:
        return False  # gone or unreadable: a rerun would only record the error again
    if stat.st_size == record.get("file_size") and stat.st_mtime_ns == record.get("file_mtime_ns"):
        return False
    return checked_sha256(path) != record.get("sha256")


def reviewed(record: dict) -> bool:
    """A label a person corrected or approved (`mmcli review`): `mmcli caption` keeps it, even with
    --overwrite, unless told --redo-reviewed."""
    review = record.get("review") or {}
    return review.get("action") in ("edit", "delete_box") or review.get("verdict") == "approved"
