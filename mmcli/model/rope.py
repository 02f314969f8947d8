"""Rotary embedding helpers shared by both towers (split-halves rotation, as the reference
implements it)."""

from __future__ import annotations

import torch

from mmcli.model import cpu_kernel


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., heads, head_dim] rotated by cos/sin [..., rotary_dim] (broadcast over heads);
    with partial rotary (rotary_dim < head_dim) the rest of each head passes through. One pass
    of pointwise.c on the CPU in float32, where it builds."""
    rotary = cos.shape[-1]
    rows = _kernel_rows(x, cos, sin)
    if rows is not None:
        cos, sin = cos.reshape(-1, rotary).contiguous(), sin.reshape(-1, rotary).contiguous()
        return cpu_kernel.rotary(rows, cos, sin).view(x.shape)
    if rotary < x.shape[-1]:
        return torch.cat([apply_rotary(x[..., :rotary], cos, sin), x[..., rotary:]], dim=-1)
    half = rotary // 2
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    # x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1], the same products and sums
    # written into one output (three passes over it instead of five, and one allocation)
    out = x * cos
    out[..., :half].addcmul_(x[..., half:], sin[..., :half], value=-1)
    out[..., half:].addcmul_(x[..., :half], sin[..., half:])
    return out


def _kernel_rows(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """x as (rows, heads, head_dim) without a copy where pointwise.c can rotate it, else None."""
    if not (
        x.device.type == "cpu"
        and x.dtype == cos.dtype == sin.dtype == torch.float32
        and x.dim() >= 3
        and x.stride(-1) == 1
        and cos.shape == sin.shape == (*x.shape[:-2], cos.shape[-1])
        and cos.shape[-1] % 2 == 0
        and cos.shape[-1] <= x.shape[-1]
        and not x.requires_grad
        and cpu_kernel.eager()
    ):
        return None
    try:
        return x.view(-1, *x.shape[-2:])
    except RuntimeError:  # leading dimensions that do not merge: torch's path
        return None
