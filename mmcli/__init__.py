"""mmcli: label image and video datasets with Qwen3-VL.

The public names load on first use, so that `import mmcli` (and `mmcli --help`) never imports torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mmcli.api.labeler import Labeler
    from mmcli.api.result import Result
    from mmcli.config import Config, SamplingParams, load_config

__all__ = ["Labeler", "Config", "Result", "SamplingParams", "load_config"]
__version__ = "0.1.0"
_HOMES = {
    "Labeler": "mmcli.api.labeler",
    "Result": "mmcli.api.result",
    "Config": "mmcli.config",
    "SamplingParams": "mmcli.config",
    "load_config": "mmcli.config",
}


def __getattr__(name: str):
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'mmcli' has no attribute {name!r}")
