"""Qwen3-VL's M-RoPE: a prompt's index (transformers' get_rope_index) and its interleaved
frequency slots, pure functions."""

from __future__ import annotations

import torch


def rope_index(
    input_ids: list[int],
    vision_grids: list[tuple[int, int, int]],
    visual_token_ids: int | tuple[int, ...],
    spatial_merge_size: int,
) -> tuple[torch.Tensor, int]:
    """[3, T] rotary position ids of one prompt and its delta (max + 1 - T).

    Text: all three rows count up together. An image's tokens (t, h/m, w/m on the merged grid,
    row-major) get T = start + ti, H = start + row, W = start + col; text after it resumes at
    max(so far) + 1. A video is one grid (1, h, w) per temporal patch, each its own span between
    timestamp texts (as the reference splits video_grid_thw), so time is carried by the text
    positions; `visual_token_ids` holds both pad ids then."""
    visual = {visual_token_ids} if isinstance(visual_token_ids, int) else set(visual_token_ids)
    grids = iter(vision_grids)
    rows: list[torch.Tensor] = []
    next_pos = 0
    i, n = 0, len(input_ids)
    while i < n:
        if input_ids[i] not in visual:
            j = i
            while j < n and input_ids[j] not in visual:
                j += 1
            rows.append(torch.arange(next_pos, next_pos + j - i).expand(3, -1))
            next_pos += j - i
            i = j
            continue
        try:
            t, h, w = next(grids)
        except StopIteration:
            raise ValueError("more image tokens than image grids") from None
        gh, gw = h // spatial_merge_size, w // spatial_merge_size
        count = t * gh * gw
        if sum(1 for token in input_ids[i : i + count] if token in visual) != count:
            raise ValueError(f"image grid {t}x{h}x{w} needs {count} consecutive image tokens")
        tt, hh, ww = torch.meshgrid(
            torch.arange(t), torch.arange(gh), torch.arange(gw), indexing="ij"
        )
        rows.append(torch.stack([tt, hh, ww]).reshape(3, -1) + next_pos)
        next_pos += max(t, gh, gw)
        i += count
    if next(grids, None) is not None:
        raise ValueError("more image grids than images in the prompt")
    ids = torch.cat(rows, dim=1) if rows else torch.zeros(3, 0, dtype=torch.long)
    delta = (int(ids.max()) + 1 if n else 0) - n
    return ids, delta


def interleaved_axes(mrope_section: tuple[int, ...] | list[int], head_dim: int) -> torch.Tensor:
    """Which axis (0 T, 1 H, 2 W) drives each of the head_dim/2 frequency slots (interleaved
    layout).

    Slots cycle T H W T H W ... while every axis still has frequencies left; the remaining slots
    go to T. For [24, 20, 20]: slot j is H when j % 3 == 1 and j < 60, W when j % 3 == 2 and j <
    60, else T."""
    half = head_dim // 2
    axes = torch.zeros(half, dtype=torch.long)
    for axis in (1, 2):
        axes[axis : 3 * mrope_section[axis] : 3] = axis
    return axes
