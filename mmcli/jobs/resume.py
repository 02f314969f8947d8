"""What makes a recorded label current: the settings it was made under (hashed into the record's `settings`),
and the image file it was made from (size and mtime, confirmed by sha256).

The settings cover everything that changes a label: the record schema, the model's identity (the hub revision, or
a digest of a local checkpoint's config.json and its weight files' headers, sizes and modification times), the
weights' and the computation's precision, the pixel budget, the prompt and the sampling.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import struct
from pathlib import Path

from mmcli.config import Config
from mmcli.inputs.images import image_processor_config
from mmcli.jobs.records import SCHEMA, file_sha256


def local_checkpoint(model: str) -> Path | None:
    """The checkpoint directory behind `model` without fetching anything: a local folder, or the hub cache's
    snapshot of a hub id (None when it is not downloaded yet)."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if model.count("/") != 1 or model.startswith((".", "/", "~")):
        return None
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, local_files_only=True))
    except Exception:  # noqa: BLE001 - not in the cache (or no cache): unknown until fetched
        return None


def model_identity(model: str, path: Path | None) -> str:
    """The hub revision of a snapshot, else a digest of config.json and every weight file's safetensors header,
    size and mtime (a changed weight file changes it; reading every weight byte would cost seconds per run)."""
    if path is None:
        return f"{model}@not-downloaded"
    real = Path(os.path.realpath(path))
    if real.parent.name == "snapshots":
        return f"revision {real.name}"
    digest = hashlib.sha256()
    for name in ("config.json", "model.safetensors.index.json"):
        if (path / name).is_file():
            digest.update(name.encode() + b"\0" + (path / name).read_bytes())
    for weights in sorted(path.glob("*.safetensors")):
        stat = weights.stat()
        digest.update(f"{weights.name}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
        with open(weights, "rb") as f:
            header = f.read(8)
            if len(header) == 8:
                digest.update(f.read(min(struct.unpack("<Q", header)[0], 100 << 20)))
    return f"digest {digest.hexdigest()[:20]}"


def label_settings(cfg: Config, path: Path | None, precision: dict) -> dict:
    """Everything a label depends on, as a JSON-able dict (`precision` from checkpoint.run_precision)."""
    image = image_processor_config(path, cfg.image.min_pixels, cfg.image.max_pixels)
    return {"schema": SCHEMA, "prompt": cfg.prompt, "model": model_identity(cfg.model, path),
            "weights_dtype": precision["weights"], "compute_dtype": precision["compute"], "quantize": cfg.quantize,
            "pixels": [image.min_pixels, image.max_pixels], "video": dataclasses.asdict(cfg.video),
            "sampling": cfg.generation.as_dict()}


def settings_hash(settings: dict) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def file_changed(path: Path, record: dict) -> bool:
    """The file differs from the one the record was made from: size or mtime differ, and so does the sha256."""
    try:
        stat = path.stat()
    except OSError:
        return False  # gone or unreadable: a rerun would only record the error again
    if stat.st_size == record.get("file_size") and stat.st_mtime_ns == record.get("file_mtime_ns"):
        return False
    return file_sha256(path) != record.get("sha256")


def planned_run(cfg: Config) -> tuple[Path | None, str, dict]:
    """(checkpoint directory if present, device type, precision) of a run of `cfg`, known before loading."""
    from mmcli.model.checkpoint import read_model_config, run_precision
    from mmcli.compiled.graphs import resolve_backend
    from mmcli.engine.runner import pick_device

    resolve_backend(cfg.compile.backend)  # a backend that cannot run is refused before anything else
    path = local_checkpoint(cfg.model)
    checkpoint_dtype = read_model_config(path).torch_dtype if path is not None else "bfloat16"
    device = "neuron" if cfg.compile.backend == "neuron" else pick_device(cfg.device).type
    return path, device, run_precision(cfg.dtype, cfg.weights_dtype, cfg.quantize, checkpoint_dtype, device)


def planned_settings(cfg: Config) -> dict:
    """The label settings a run of `cfg` will have, known before loading (and without fetching) the model."""
    path, _, precision = planned_run(cfg)
    return label_settings(cfg, path, precision)


def load_description(cfg: Config) -> str:
    """What is about to load, for the status line: the model, its size on disk, the device and the precision."""
    path, device, precision = planned_run(cfg)
    dtype = f"{precision['weights']} weights, {precision['compute']} compute"
    if path is None:
        return f"{cfg.model} (not downloaded yet) on {device}, {dtype}"
    size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    shown = f"{size / 1e9:.2f} GB" if size >= 1e8 else f"{size / 1e6:.1f} MB"
    return f"{cfg.model} ({shown}) on {device}, {dtype}"
