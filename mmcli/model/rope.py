"""Rotary embedding helpers shared by both towers (split-halves rotation, as the reference
implements it)."""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., heads, head_dim] rotated by cos/sin [..., head_dim] (broadcast over heads)."""
    return x * cos.unsqueeze(-2) + rotate_half(x) * sin.unsqueeze(-2)
