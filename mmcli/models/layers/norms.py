"""RMSNorm as both families use it: Qwen3-VL's scales by its weight after casting back to the
activation dtype; Qwen3.5's scales by (1 + weight) in float32, then casts."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    work = "norm"  # the kind of work the kernel plan installs a kernel for
    kernel = None  # (x, weight, eps) -> y, or None where x is not the kernel's

    def __init__(self, dim: int, eps: float, unit_offset: bool = False):
        super().__init__()
        self.eps, self.unit_offset = eps, unit_offset
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and not self.unit_offset:
            if self.kernel is not None and (y := self.kernel(x, self.weight, self.eps)) is not None:
                return y
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:  # Qwen3.5: scale by (1 + weight) in float32, then cast
            return (normed * (1.0 + self.weight.float())).to(x.dtype)
        # Qwen3-VL: cast back to the activation dtype, then scale (as the reference does)
        return self.weight * normed.to(x.dtype)
