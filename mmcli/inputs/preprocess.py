"""Images to pixel values: rescale, normalise and patchify, as transformers' Qwen2-VL image
processor (PIL)."""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image

from mmcli.errors import ImageError
from mmcli.inputs.images import (
    _RESAMPLE,
    DecodedImage,
    ImageProcessorConfig,
    decode_image,
    resized_size,
    smart_resize,
)

__all__ = [
    "DecodedImage",
    "ImageProcessorConfig",
    "decode_image",
    "preprocess",
    "preprocess_video",
    "smart_resize",
]


def _normalized(
    image: Image.Image, height: int, width: int, cfg: ImageProcessorConfig
) -> torch.Tensor:
    """Resized, rescaled and normalised RGB -> [C, H, W] float32."""
    if (height, width) != (image.height, image.width):
        image = image.resize((width, height), resample=_RESAMPLE[cfg.resample])
    x = np.asarray(image)  # [H, W, C] uint8
    if cfg.do_rescale:
        x = (x.astype(np.float64) * cfg.rescale_factor).astype(np.float32)
    x = x.astype(np.float32)
    if cfg.do_normalize:
        x = (x - np.asarray(cfg.image_mean, np.float32)) / np.asarray(cfg.image_std, np.float32)
    return torch.from_numpy(np.ascontiguousarray(x)).permute(2, 0, 1)


def _patchify(
    frames: torch.Tensor, cfg: ImageProcessorConfig
) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """[tp, C, H, W] (one temporal patch) -> ([h*w, C*tp*P*P], (1, h, w)), merge-block order."""
    tp, c, height, width = frames.shape
    p, m = cfg.patch_size, cfg.merge_size
    gh, gw = height // p, width // p
    if gh % m or gw % m:
        raise ImageError(f"resized size {height}x{width} is not a multiple of {p * m}")
    # (tp, C, gh/m, m, p, gw/m, m, p) -> (gh/m, gw/m, m, m, C, tp, p, p), as the reference's
    # patchify.
    x = frames.reshape(tp, c, gh // m, m, p, gw // m, m, p).permute(2, 5, 3, 6, 1, 0, 4, 7)
    return x.reshape(gh * gw, c * tp * p * p).contiguous(), (1, gh, gw)


def preprocess(
    image: Image.Image, cfg: ImageProcessorConfig
) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """RGB image -> (pixel_values [t*h*w, C*T*P*P] float32, grid (t, h, w) in patches),
    merge-block order."""
    x = _normalized(image, *resized_size(image, cfg), cfg)
    # `tp` identical frames
    return _patchify(x.unsqueeze(0).expand(cfg.temporal_patch_size, *x.shape), cfg)


def preprocess_video(
    frames: list[Image.Image], size: tuple[int, int], cfg: ImageProcessorConfig
) -> list[tuple[torch.Tensor, tuple[int, int, int]]]:
    """Sampled frames -> one (pixel_values, (1, h, w)) per temporal patch: every frame resized to
    `size`, the list padded with its last frame to a multiple of the patch (as the reference
    pads)."""
    tp = cfg.temporal_patch_size
    frames = list(frames) + [frames[-1]] * (-len(frames) % tp)
    stack = torch.stack([_normalized(f, *size, cfg) for f in frames])
    return [_patchify(stack[i : i + tp], cfg) for i in range(0, len(frames), tp)]
