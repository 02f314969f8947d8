"""mmcli: label image datasets with Qwen3-VL.

The public names load on first use, so that `import mmcli` (and `mmcli --help`) never imports torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .captioner import Captioner
    from .config import Config, SamplingParams, load_config
    from .output import Result

__all__ = ["Captioner", "Config", "Result", "SamplingParams", "load_config"]
__version__ = "0.1.0"
_HOMES = {"Captioner": "captioner", "Result": "output", "Config": "config", "SamplingParams": "config",
          "load_config": "config"}


def __getattr__(name: str):
    if name in _HOMES:
        return getattr(importlib.import_module(f".{_HOMES[name]}", __name__), name)
    raise AttributeError(f"module 'mmcli' has no attribute {name!r}")
