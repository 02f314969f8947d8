"""M-RoPE positions (decode positions, each frequency slot turned by its position stream), as pure
functions; a prompt's rotary ids and which stream turns each slot are its family's
(`Family.rope_index`, `Family.rotary_axes`).

Two position streams reach every forward pass: `positions` [T], sequential per sequence (KV-cache
slots and the causal mask), and `rotary_position_ids` [3, T], the T/H/W ids that only the rotary
embedding reads."""

from __future__ import annotations

import torch


def decode_rotary_position_ids(positions: torch.Tensor, deltas: torch.Tensor) -> torch.Tensor:
    """Rotary ids [3, B] for generated tokens at sequential `positions` [B]: position + delta on
    every axis."""
    return (positions + deltas).unsqueeze(0).expand(3, -1)


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
