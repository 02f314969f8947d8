"""mmcli: label image datasets with Qwen3-VL."""

import os
import sys

# Idle OpenMP threads sleep rather than spin, so that a decode GEMV split across threads (model/text.py) is not
# slowed by threads spinning after the previous op (2B decode step on 2 cores: 445 ms against 540 ms unsplit,
# 624 ms split with spinning threads). OpenMP reads this once, when torch loads: set it only if it can still act.
if "torch" not in sys.modules:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from .captioner import Captioner, Result  # noqa: E402
from .config import Config, load_config  # noqa: E402
from .sampling import SamplingParams  # noqa: E402

__all__ = ["Captioner", "Config", "Result", "SamplingParams", "load_config"]
__version__ = "0.1.0"
