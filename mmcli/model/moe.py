"""Sparse MLP blocks of the MoE models (transformers' `Qwen3VLMoeTextSparseMoeBlock` and
`Qwen3_5MoeSparseMoeBlock`): a router picks each token's top-k experts and normalises their
weights; Qwen3.5's add a shared expert scaled by a sigmoid gate.

The experts' weights are 3-D, as transformers holds them: gate_up_proj [E, 2I, H] and down_proj
[E, H, I]. Tokens are grouped by expert, so each expert's weights are read once per call, for the
tokens routed to it, and an expert no token chose is not read at all."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mmcli.model.config import TextConfig
from mmcli.model.int4 import Int4Weight, int4_linear
from mmcli.model.linear import Linear


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Experts(nn.Module):
    int4: list[tuple[Int4Weight, Int4Weight, Int4Weight]] | None = (
        None  # per expert: gate, up, down
    )

    def __init__(self, cfg: TextConfig):
        super().__init__()
        experts, hidden, inner = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * inner, hidden))
        self.down_proj = nn.Parameter(torch.empty(experts, hidden, inner))

    def adopt_int4(self, weights: list[tuple[Int4Weight, Int4Weight, Int4Weight]]) -> None:
        """Hold the experts as 4-bit weights (quantized as they were read) instead of the 3-D
        parameters."""
        del self.gate_up_proj, self.down_proj
        self.int4 = weights

    @property
    def int4_bytes(self) -> int:
        return sum(w.nbytes for expert in self.int4 or [] for w in expert)

    def _expert(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        if self.int4 is not None:
            gate, up, down = self.int4[expert]
            return int4_linear(
                F.silu(int4_linear(x, gate, None)) * int4_linear(x, up, None), down, None
            )
        # weights held lower (bfloat16 on the CPU) compute in x's dtype
        gate, up = F.linear(x, self.gate_up_proj[expert].to(x.dtype)).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.down_proj[expert].to(x.dtype))

    def forward(self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor):
        """x [T, H]; chosen, weights [T, k] -> the weighted sum of each token's experts [T, H]."""
        out = torch.zeros_like(x)
        flat = chosen.flatten()
        order = flat.argsort(stable=True)
        rows = order // chosen.shape[1]  # the token of each (token, choice), grouped by expert
        scales = weights.flatten()[order]
        counts = torch.bincount(flat, minlength=len(self.int4 or self.gate_up_proj)).tolist()
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            group = rows[start : start + count]
            y = self._expert(expert, x[group])
            out.index_add_(0, group, y * scales[start : start + count, None])
            start += count
        return out


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.gate = Linear(cfg.hidden_size, cfg.num_experts, bias=False)  # the router
        self.experts = Experts(cfg)
        self.shared_expert = None
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = MLP(cfg.hidden_size, cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)
        weights, chosen = torch.topk(logits.softmax(-1, dtype=torch.float), self.top_k, dim=-1)
        weights = (weights / weights.sum(-1, keepdim=True)).to(logits.dtype)
        out = self.experts(x, chosen, weights)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
