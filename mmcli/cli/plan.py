"""`mmcli plan`: how the inputs pack into vision blocks, as a Rich table, and the block size to
use."""

from __future__ import annotations

import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from mmcli.config import Config
from mmcli.engine.packing import (
    ffd_pack,
    flat_efficiency,
    packed_efficiency,
    padded_efficiency,
    recommend_block_size,
    vision_calls,
)
from mmcli.errors import ImageError


def image_patches(
    paths: list[Path], cfg: Config, columns: tuple[str | None, str | None] = (None, None)
) -> tuple[list[str], list[int]]:
    """Patch counts of the images under `paths`, decoded and sized exactly as a run does (a local
    checkpoint's preprocessor_config.json, else Qwen3-VL's, with the configured pixel budget); a
    video counts one segment per temporal patch (`key#k`), sized from its headers as a run sizes
    it."""
    # numpy and Pillow: only with files
    from mmcli.inputs.images import (
        decode_image,
        image_processor_config,
        num_patches,
    )
    from mmcli.inputs.sources import describe, suffix
    from mmcli.inputs.video import VideoSampling, probe_video, video_smart_resize
    from mmcli.jobs.scan import scan

    local = Path(cfg.model).expanduser()
    checkpoint = local if local.is_dir() else None
    image_cfg = image_processor_config(checkpoint, cfg.image.min_pixels, cfg.image.max_pixels)
    videos = VideoSampling.from_checkpoint(checkpoint, cfg.video, image_cfg.max_pixels)
    names, patches = [], []
    media = cfg.scan.extensions + cfg.scan.video_extensions
    for key, path in scan(paths, media, columns=columns):
        try:
            if cfg.scan.is_video(suffix(path)):
                frames, height, width = probe_video(path, videos)
                height, width = video_smart_resize(frames, height, width, videos)
                groups = -(-frames // image_cfg.temporal_patch_size)
                names += [f"{key}#{k}" for k in range(groups)]
                patches += [height * width // image_cfg.patch_size**2] * groups
                continue
            patches.append(
                num_patches(decode_image(path, cfg.image.max_decode_pixels).image, image_cfg)
            )
        except ImageError as e:
            print(f"mmcli: {describe(path)}: skipped ({e})", file=sys.stderr)
            continue
        names.append(key)
    return names, patches


def print_plan(names: list[str], patches: list[int], size: int, most_blocks: int) -> None:
    """The blocks of a wave of these images, and the calls eager on the CPU makes of them
    (`most_blocks` a call: vision.num_blocks_buckets' largest)."""
    bins = ffd_pack(patches, size)
    console = Console(width=100)
    table = Table(title=f"{len(patches)} images in {len(bins)} blocks of {size} patches")
    for col in ("block", "images", "patches", "fill"):
        table.add_column(col, justify="right" if col != "images" else "left")
    for b, images in enumerate(bins):
        used = sum(patches[i] for i in images)
        shown = ", ".join(f"{names[i]} ({patches[i]})" for i in sorted(images)[:6])
        table.add_row(
            str(b),
            shown + (" …" if len(images) > 6 else ""),
            str(used),
            f"{100 * used / size:.1f}%",
        )
    console.print(table)
    console.print(
        f"attention efficiency, blocks of {size}: "
        f"{100 * packed_efficiency(patches, len(bins), size):.1f}%"
    )
    console.print(
        "attention efficiency, one flat sequence with a mask: "
        f"{100 * flat_efficiency(patches):.1f}%"
    )
    console.print(
        "attention efficiency, each image padded to the largest: "
        f"{100 * padded_efficiency(patches):.1f}%"
    )
    best = recommend_block_size(patches)
    best_blocks = len(ffd_pack(patches, best))
    console.print(
        f"recommended block_size: {best} ({best_blocks} blocks, "
        f"{100 * packed_efficiency(patches, best_blocks, best):.1f}% attention efficiency, least "
        "estimated vision work: padded linear layers plus block attention)"
    )
    calls = vision_calls(bins, most_blocks)
    longest = max(sum(patches[i] for b in call for i in b) for call in calls)
    console.print(
        f"eager on the CPU: {len(calls)} call(s) of up to {most_blocks} blocks, each one row of "
        f"its blocks end to end, no padding ({longest} patches at most; the figures above are "
        "the compiled backends')"
    )
