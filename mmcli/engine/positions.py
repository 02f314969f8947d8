"""M-RoPE positions (decode positions, interleaved frequency slots), as pure functions; a prompt's
rotary ids are its family's (models/qwen3_vl/rope_index.py).

Two position streams reach every forward pass: `positions` [T], sequential per sequence (KV-cache
slots and the causal mask), and `rotary_position_ids` [3, T], the T/H/W ids that only the rotary
embedding reads."""

from __future__ import annotations

import torch


def decode_rotary_position_ids(positions: torch.Tensor, deltas: torch.Tensor) -> torch.Tensor:
    """Rotary ids [3, B] for generated tokens at sequential `positions` [B]: position + delta on
    every axis."""
    return (positions + deltas).unsqueeze(0).expand(3, -1)


def mrope_slot_axes(mrope_section: tuple[int, ...] | list[int], head_dim: int) -> torch.Tensor:
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


def text_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))


def mrope_angles(
    rotary_position_ids: torch.Tensor, inv_freq: torch.Tensor, slot_axes: torch.Tensor
) -> torch.Tensor:
    """Rotation angles [T, head_dim/2] (float32): slot j turns by position[axis of j] *
    inv_freq[j]."""
    pos = rotary_position_ids.to(torch.float32)  # [3, T]
    slot_pos = pos[slot_axes.to(pos.device)]  # [half, T]: the position each slot rotates by
    return slot_pos.t() * inv_freq.to(pos.device)


def mrope_cos_sin(
    rotary_position_ids: torch.Tensor, inv_freq: torch.Tensor, slot_axes: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, head_dim] (float32) for rotary ids [3, T], halves duplicated (split-halves
    rotation)."""
    freqs = mrope_angles(rotary_position_ids, inv_freq, slot_axes)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()
