"""Images in, without torch: decode with Pillow (orientation, modes, guards), the pixel budget
and smart_resize.

`caption`, `ask` and `plan` all size images here, so a plan cannot disagree with a run."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps

from mmcli.errors import ImageError
from mmcli.inputs.sources import Source, read_source
from mmcli.models.config import QWEN_MERGE_SIZE, QWEN_PATCH_SIZE, QWEN_TEMPORAL_PATCH_SIZE

_RESAMPLE = {
    0: Image.NEAREST,
    1: Image.LANCZOS,
    2: Image.BILINEAR,
    3: Image.BICUBIC,
    4: Image.BOX,
    5: Image.HAMMING,
}


@dataclass(frozen=True)
class ImageProcessorConfig:
    """The fields of preprocessor_config.json that decide the pixels (Qwen3-VL values as
    defaults)."""

    min_pixels: int = 256 * 256
    max_pixels: int = 4096 * 4096
    patch_size: int = QWEN_PATCH_SIZE
    temporal_patch_size: int = QWEN_TEMPORAL_PATCH_SIZE
    merge_size: int = QWEN_MERGE_SIZE
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255
    resample: int = 3
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @classmethod
    def from_checkpoint(cls, path: Path) -> ImageProcessorConfig:
        file = path / "preprocessor_config.json"
        raw = json.loads(file.read_text()) if file.is_file() else {}
        size = raw.get("size") or {}
        fields = {
            k: raw[k]
            for k in (
                "patch_size",
                "temporal_patch_size",
                "merge_size",
                "rescale_factor",
                "resample",
                "do_resize",
                "do_rescale",
                "do_normalize",
            )
            if k in raw
        }
        for k in ("image_mean", "image_std"):
            if k in raw:
                fields[k] = tuple(raw[k])
        fields["min_pixels"] = size.get("shortest_edge", raw.get("min_pixels", cls.min_pixels))
        fields["max_pixels"] = size.get("longest_edge", raw.get("max_pixels", cls.max_pixels))
        return cls(**fields)


@dataclass(frozen=True)
class DecodedImage:
    image: Image.Image  # RGB, EXIF orientation applied
    note: str | None = None  # e.g. "first frame of 12 used"
    file: dict | None = None  # the facts of the bytes decoded (sources.read_source)


def smart_resize(
    height: int, width: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """Target (height, width): multiples of `factor`, pixel count within bounds, aspect ratio
    kept."""
    if max(height, width) / min(height, width) > 200:
        raise ImageError(
            f"aspect ratio {max(height, width) / min(height, width):.0f}:1 is over 200:1"
        )
    h_bar = round(height / factor) * factor  # Python round: half to even, as the reference does
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _to_rgb(im: Image.Image) -> Image.Image:
    if im.mode in ("I;16", "I;16B", "I;16L", "I", "F"):
        # 16-bit and float greys: Pillow's convert("L") clips instead of scaling; scale to 8 bits
        # ourselves.
        arr = np.asarray(im).astype(np.float64)
        peak = 65535.0 if im.mode.startswith("I;16") or arr.max(initial=0) > 255 else 255.0
        if im.mode == "F" and arr.max(initial=0) <= 1.0:
            peak = 1.0
        im = Image.fromarray(
            np.clip(np.round(arr * (255.0 / peak)), 0, 255).astype(np.uint8), mode="L"
        )
    has_alpha = "A" in im.getbands() or im.info.get("transparency") is not None
    if has_alpha:  # composite onto white, as the reference's convert_to_rgb does
        rgba = im.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return im.convert("RGB")


def decode_image(source: Source, max_decode_pixels: int = 128 * 1024 * 1024) -> DecodedImage:
    """Open one image (a file, a shard member, a Parquet cell) as RGB, or raise ImageError naming
    what is wrong with it."""
    try:
        opened = read_source(Path(source) if isinstance(source, str) else source)
        with Image.open(opened.data) as im:
            width, height = im.size
            if width * height > max_decode_pixels:
                raise ImageError(
                    f"{width}x{height} pixels is over the decode limit of {max_decode_pixels} "
                    "(image.max_decode_pixels); refusing a possible decompression bomb"
                )
            frames = getattr(im, "n_frames", 1)
            im.seek(0)
            im.load()
            im = ImageOps.exif_transpose(im) or im
            rgb = _to_rgb(im)
    except ImageError:
        raise
    except Image.DecompressionBombError as e:
        raise ImageError(f"decompression bomb: {e}") from None
    except Image.UnidentifiedImageError:
        raise ImageError("not an image Pillow can read (unknown or corrupt format)") from None
    except (OSError, SyntaxError, ValueError) as e:
        raise ImageError(f"cannot decode (corrupt or truncated): {e}") from None
    note = f"first frame of {frames} used" if frames > 1 else None
    return DecodedImage(rgb, note, opened.facts)


def image_processor_config(
    path: Path | None, min_pixels: int | None, max_pixels: int
) -> ImageProcessorConfig:
    """The checkpoint's preprocessor settings (Qwen3-VL's own without a checkpoint directory),
    with the pixel budget the settings give: image.min_pixels replaces the checkpoint's,
    image.max_pixels caps it."""
    base = (
        ImageProcessorConfig.from_checkpoint(path) if path is not None else ImageProcessorConfig()
    )
    return replace(
        base, max_pixels=min(base.max_pixels, max_pixels), min_pixels=min_pixels or base.min_pixels
    )


def resized_size(image: Image.Image, cfg: ImageProcessorConfig) -> tuple[int, int]:
    """(height, width) the image is resized to before patchifying."""
    if not cfg.do_resize:
        return image.height, image.width
    return smart_resize(image.height, image.width, cfg.factor, cfg.min_pixels, cfg.max_pixels)


def num_patches(image: Image.Image, cfg: ImageProcessorConfig) -> int:
    height, width = resized_size(image, cfg)
    return (height // cfg.patch_size) * (width // cfg.patch_size)
