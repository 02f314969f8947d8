"""The dense MLP of the text decoder and its SwiGLU."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mmcli.models.layers.linear import Linear


class SiluAndMul(nn.Module):
    """silu(gate) * up, the SwiGLU; the installed kernel may write into gate (callers hand over a
    gate they do not keep). The kernel takes bfloat16 gate and up as well, products handed on as
    they are (Linear's `rounded`): computed in float32, rounded once for down's product."""

    work = "swiglu"
    kernel = None  # (gate, up) -> silu(gate) * up, or None where they are not the kernel's

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            if (y := self.kernel(gate, up)) is not None:
                return y
            if gate.dtype == torch.bfloat16:  # handed on in a float32 run (the kernel's only)
                gate, up = gate.float(), up.float()
        return F.silu(gate) * up


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # gate and up as their products give them (bfloat16 where the run's are), the SwiGLU's
        # output as down's product reads it: no pass widens or rounds them in between
        gate, up = self.gate_proj(x, rounded=True), self.up_proj(x, rounded=True)
        # down's as its product gives it: the next norm adds it to the residual stream
        return self.down_proj(self.act(gate, up), rounded=True)
