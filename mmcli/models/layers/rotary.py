"""The rotary embedding shared by both towers (split-halves rotation, as the reference
implements it)."""

from __future__ import annotations

import torch
from torch import nn

from mmcli.models.layers.norms import RMSNorm


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., heads, head_dim] rotated by cos/sin [..., rotary_dim] (broadcast over heads);
    with partial rotary (rotary_dim < head_dim) the rest of each head passes through."""
    rotary = cos.shape[-1]
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


class Rotary(nn.Module):
    """apply_rotary as a layer, so that the kernel plan can install a kernel for it (it holds no
    weights). `norm`: a per-head RMSNorm (Qwen3's q and k norms) applied first, in the kernel's
    pass where it takes both. x may be a product's bfloat16 outputs handed on (Linear's
    `rounded`), widened exactly to the compute dtype (cos's)."""

    work = "rotary"
    # (x, cos, sin, norm weight or None, eps) -> rotated, or None where x is not the kernel's
    kernel = None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, norm: RMSNorm | None = None
    ) -> torch.Tensor:
        if norm is not None and norm.unit_offset:  # a norm the kernel does not take: first
            x, norm = norm(x.to(cos.dtype)), None
        if self.kernel is not None:
            weight, eps = (norm.weight, norm.eps) if norm is not None else (None, 0.0)
            if (y := self.kernel(x, cos, sin, weight, eps)) is not None:
                return y
        x = x.to(cos.dtype)
        return apply_rotary(x if norm is None else norm(x), cos, sin)
