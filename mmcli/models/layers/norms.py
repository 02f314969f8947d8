"""RMSNorm as both families use it: Qwen3-VL's scales by its weight after casting back to the
activation dtype; Qwen3.5's scales by (1 + weight) in float32, then casts. LayerNorm as the vision
tower uses it. Each norm's `add_and_norm` takes the residual stream's add with it, one pass where
the installed kernel runs both; where the plan sets `rounded` (every reader's product rounds its
input to bfloat16), the kernel hands the output on so: one rounding in place of one a reader."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    work = "norm"  # the kind of work the kernel plan installs a kernel for
    # (x, update or None, weight, eps, rounded) -> (x + update, norm), or None where they are not
    # the kernel's
    kernel = None
    rounded = False  # the kernel's output in bfloat16 (set by the plan: hand_on_norms)

    def __init__(self, dim: int, eps: float, unit_offset: bool = False):
        super().__init__()
        self.eps, self.unit_offset = eps, unit_offset
        self.weight = nn.Parameter(torch.ones(dim))

    def add_and_norm(
        self, x: torch.Tensor, update: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + update, its norm): the residual stream's add and this norm; `update` may be a
        product's bfloat16 outputs handed on (Linear's `rounded`), widened exactly."""
        if self._fused(x) and (done := self.kernel(x, update, self.weight, self.eps, self.rounded)):
            return done
        total = x + update.to(x.dtype)
        return total, self(total)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._fused(x) and (done := self.kernel(x, None, self.weight, self.eps, self.rounded)):
            return done[1]
        if x.dtype == torch.float32 and not self.unit_offset:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:  # Qwen3.5: scale by (1 + weight) in float32, then cast
            return (normed * (1.0 + self.weight.float())).to(x.dtype)
        # Qwen3-VL: cast back to the activation dtype, then scale (as the reference does)
        return self.weight * normed.to(x.dtype)

    def _fused(self, x: torch.Tensor) -> bool:
        return self.kernel is not None and x.dtype == torch.float32 and not self.unit_offset


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm (the checkpoint's weight and bias), in float32, with the residual stream's add
    (add_and_norm) and the kernel's bfloat16 output as RMSNorm's."""

    work = "layer_norm"  # the kind of work the kernel plan installs a kernel for
    # (x, update or None, weight, bias, eps, rounded) -> (x + update, norm), or None
    kernel = None
    rounded = False

    def add_and_norm(
        self, x: torch.Tensor, update: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + update, its norm), as RMSNorm's."""
        if (done := self._kernel(x, update)) is not None:
            return done
        total = x + update.to(x.dtype)
        return total, super().forward(total)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        done = self._kernel(x, None)
        return super().forward(x) if done is None else done[1]

    def _kernel(self, x: torch.Tensor, update: torch.Tensor | None):
        if self.kernel is None or x.dtype != torch.float32:
            return None
        return self.kernel(x, update, self.weight, self.bias, self.eps, self.rounded)
