"""The dense MLP of the text decoder and its SwiGLU."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mmcli.models.layers.linear import Linear


class SiluAndMul(nn.Module):
    """silu(gate) * up, the SwiGLU; the installed kernel may write into gate (callers hand over a
    gate they do not keep)."""

    work = "swiglu"
    kernel = None  # (gate, up) -> silu(gate) * up, or None where they are not the kernel's

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None and (y := self.kernel(gate, up)) is not None:
            return y
        return F.silu(gate) * up


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x), self.up_proj(x)))
