"""Rotary embedding helpers shared by both towers (split-halves rotation, as the reference
implements it)."""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., heads, head_dim] rotated by cos/sin [..., rotary_dim] (broadcast over heads);
    with partial rotary (rotary_dim < head_dim) the rest of each head passes through."""
    rotary = cos.shape[-1]
    if rotary < x.shape[-1]:
        return torch.cat([apply_rotary(x[..., :rotary], cos, sin), x[..., rotary:]], dim=-1)
    return x * cos.unsqueeze(-2) + rotate_half(x) * sin.unsqueeze(-2)
