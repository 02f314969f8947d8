"""Images to pixel values: rescale, normalise and patchify, as transformers' Qwen2-VL image processor (PIL)."""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image

from .errors import ImageError
from .images import _RESAMPLE, DecodedImage, ImageProcessorConfig, decode_image, resized_size, smart_resize

__all__ = ["DecodedImage", "ImageProcessorConfig", "decode_image", "preprocess", "smart_resize"]


def preprocess(image: Image.Image, cfg: ImageProcessorConfig) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """RGB image -> (pixel_values [t*h*w, C*T*P*P] float32, grid (t, h, w) in patches), merge-block order."""
    height, width = resized_size(image, cfg)
    if (height, width) != (image.height, image.width):
        image = image.resize((width, height), resample=_RESAMPLE[cfg.resample])
    x = np.asarray(image)  # [H, W, C] uint8
    if cfg.do_rescale:
        x = (x.astype(np.float64) * cfg.rescale_factor).astype(np.float32)
    x = x.astype(np.float32)
    if cfg.do_normalize:
        x = (x - np.asarray(cfg.image_mean, np.float32)) / np.asarray(cfg.image_std, np.float32)
    x = torch.from_numpy(np.ascontiguousarray(x)).permute(2, 0, 1)  # [C, H, W]
    c, height, width = x.shape
    p, m, tp = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    gh, gw = height // p, width // p
    if gh % m or gw % m:
        raise ImageError(f"resized size {height}x{width} is not a multiple of {p * m}")
    # (C, gh/m, m, p, gw/m, m, p) -> (gh/m, gw/m, m, m, C, p, p); one image is `tp` identical frames.
    x = x.reshape(c, gh // m, m, p, gw // m, m, p).permute(1, 4, 2, 5, 0, 3, 6)
    x = x.unsqueeze(5).expand(*x.shape[:5], tp, p, p)
    return x.reshape(gh * gw, c * tp * p * p).contiguous(), (1, gh, gw)
