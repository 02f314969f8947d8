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

from mmcli.model import cpu_kernel
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
        return self.down_proj(silu_times(self.gate_proj(x), self.up_proj(x)))


def silu_times(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, the SwiGLU; in one pass on the CPU in float32 (pointwise.c, into gate:
    callers hand over a gate they do not keep)."""
    if (
        gate.device.type == "cpu"
        and gate.dtype == up.dtype == torch.float32
        and gate.shape == up.shape
        and gate.is_contiguous()
        and up.is_contiguous()
        and not gate.requires_grad
        and cpu_kernel.eager()
    ):
        return cpu_kernel.silu_times(gate, up)
    return F.silu(gate) * up


def expert_ffn(gate_up: torch.Tensor, down: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """One expert on the rows routed to it; weights held lower (bfloat16 on the CPU) compute in
    x's dtype."""
    gate, up = F.linear(x, gate_up.to(x.dtype)).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, down.to(x.dtype))


def int4_expert_ffn(weights: tuple[Int4Weight, Int4Weight, Int4Weight], x: torch.Tensor):
    gate, up, down = weights
    return int4_linear(silu_times(int4_linear(x, gate, None), int4_linear(x, up, None)), down, None)


def _grouped(chosen: torch.Tensor, weights: torch.Tensor):
    """Each (token, choice) pair's token row and weight, sorted by expert (stable: a token's order
    within its expert is its order in the batch)."""
    order = chosen.flatten().argsort(stable=True)
    return order // chosen.shape[1], weights.flatten()[order]


def grouped_loop(x, chosen, weights, experts: int, ffn) -> torch.Tensor:
    """x [T, H]; chosen, weights [T, k] -> the weighted sum of each token's experts [T, H]:
    `ffn(e, rows)` once per expert chosen, on its rows (the counts are read on the host)."""
    rows, scales = _grouped(chosen, weights)
    counts = torch.bincount(chosen.flatten(), minlength=experts).tolist()
    out = torch.zeros_like(x)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        group = rows[start : start + count]
        y = ffn(expert, x[group])
        out.index_add_(0, group, y * scales[start : start + count, None])
        start += count
    return out


# The loop reads the routing on the host, which a fixed-shape graph cannot trace: as a custom op
# the compiler calls it as it is (inductor's fullgraph buckets then hold MoE layers too).
@torch.library.custom_op("mmcli::grouped_experts", mutates_args=())
def grouped_experts(
    x: torch.Tensor,
    chosen: torch.Tensor,
    weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
) -> torch.Tensor:
    def ffn(expert: int, rows: torch.Tensor) -> torch.Tensor:
        return expert_ffn(gate_up_proj[expert], down_proj[expert], rows)

    return grouped_loop(x, chosen, weights, len(gate_up_proj), ffn)


@grouped_experts.register_fake
def _(x, chosen, weights, gate_up_proj, down_proj):
    return torch.empty_like(x)


def grouped_gemm(x, chosen, weights, gate_up_proj, down_proj) -> torch.Tensor:
    """The same sum by torch's grouped GEMM (one kernel over every expert's rows, offsets kept on
    the device: no host sync). For CUDA with bfloat16 weights and activations."""
    rows, scales = _grouped(chosen, weights)
    counts = torch.bincount(chosen.flatten(), minlength=len(gate_up_proj))
    offsets = counts.cumsum(0, dtype=torch.int32)
    grouped_mm = getattr(F, "grouped_mm", None) or torch._grouped_mm
    gate, up = grouped_mm(x[rows], gate_up_proj.transpose(1, 2), offs=offsets).chunk(2, dim=-1)
    y = grouped_mm(F.silu(gate) * up, down_proj.transpose(1, 2), offs=offsets)
    return torch.zeros_like(x).index_add_(0, rows, y * scales[:, None])


def can_grouped_gemm(x: torch.Tensor, held: torch.Tensor) -> bool:
    has = hasattr(F, "grouped_mm") or hasattr(torch, "_grouped_mm")
    return has and x.is_cuda and x.dtype == held.dtype == torch.bfloat16


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

    def forward(self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor):
        """x [T, H]; chosen, weights [T, k] -> the weighted sum of each token's experts [T, H]."""
        if self.int4 is not None:
            experts = self.int4
            return grouped_loop(
                x, chosen, weights, len(experts), lambda e, rows: int4_expert_ffn(experts[e], rows)
            )
        held = (self.gate_up_proj, self.down_proj)
        if can_grouped_gemm(x, self.gate_up_proj):
            return grouped_gemm(x, chosen, weights, *held)
        return grouped_experts(x, chosen, weights, *held)


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
