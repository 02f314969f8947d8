"""mmcli: label image datasets with Qwen3-VL."""

from .captioner import Captioner, Result
from .config import Config, load_config
from .sampling import SamplingParams

__all__ = ["Captioner", "Config", "Result", "SamplingParams", "load_config"]
__version__ = "0.1.0"
