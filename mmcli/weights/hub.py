"""Where a checkpoint is: a local directory, or a hub id fetched once with huggingface_hub
(torch-free)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from mmcli.errors import CheckpointError
from mmcli.models.config import DEFAULT_MODEL, ModelConfig
from mmcli.models.registry import parse_config


def is_hub_id(model: str) -> bool:
    """`owner/name`, not a path."""
    return model.count("/") == 1 and not model.startswith((".", "/", "~"))


def resolve_model(model: str) -> Path:
    """A local checkpoint directory, or a hub id fetched (once) with huggingface_hub."""
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise CheckpointError(
                f"{path}: no config.json; not a Hugging Face checkpoint directory"
            )
        return path
    if path.exists() or not is_hub_id(model):
        raise CheckpointError(
            f"{model}: no such checkpoint directory (and not a hub id like {DEFAULT_MODEL})"
        )
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.jinja", "*.safetensors", "*.txt"]
    try:
        return Path(snapshot_download(model, allow_patterns=patterns))
    except Exception as e:  # noqa: BLE001 - any hub failure ends the same way for the user
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(
            f"{model}: cannot fetch from the Hugging Face hub ({reason[:160]}); download it "
            "elsewhere and pass the local directory with --model /path/to/checkpoint (or set "
            "HF_HUB_OFFLINE=1 to use the cache)"
        ) from None


def local_checkpoint(model: str) -> Path | None:
    """The checkpoint directory behind `model` without fetching anything: a local folder, or the
    hub cache's snapshot of a hub id (None when it is not downloaded yet)."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if not is_hub_id(model):
        return None
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, local_files_only=True))
    except Exception:  # noqa: BLE001 - not in the cache (or no cache): unknown until fetched
        return None


def snapshot_revision(path: Path) -> str | None:
    """The hub snapshot hash when `path` is a huggingface_hub snapshot, else None."""
    parts = Path(os.path.realpath(path)).parts
    return parts[-1] if len(parts) > 2 and parts[-2] == "snapshots" else None


def read_ahead(model: str) -> int:
    """Ask the kernel to start reading the checkpoint's weight files into the page cache now
    (POSIX_FADV_WILLNEED: asynchronous), so a cold read overlaps torch's import and the setup
    that follow instead of waiting for them. Returns the bytes asked for; MMCLI_READ_AHEAD=0
    turns it off (bench/cpu.py compares both)."""
    path = local_checkpoint(model)
    if path is None or os.environ.get("MMCLI_READ_AHEAD") == "0":
        return 0
    asked = 0
    for file in sorted(path.glob("*.safetensors")):
        try:
            fd = os.open(file, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
                asked += os.fstat(fd).st_size
            finally:
                os.close(fd)
        except (OSError, AttributeError):  # no posix_fadvise on this platform: nothing to gain
            return asked
    return asked


def read_config(path: Path) -> tuple[bytes, ModelConfig]:
    """config.json's bytes, read once, and the model's shape its family reads from them."""
    file = path / "config.json"
    try:
        data = file.read_bytes()
        raw = json.loads(data)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{file}: cannot read ({e})") from None
    return data, parse_config(raw, str(file))
