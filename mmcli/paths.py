"""Where mmcli keeps what it makes for itself (torch-free, below every other layer)."""

from __future__ import annotations

import os
from pathlib import Path


def mmcli_cache() -> Path:
    """mmcli's own cache directory: $XDG_CACHE_HOME/mmcli, else ~/.cache/mmcli."""
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "mmcli"
