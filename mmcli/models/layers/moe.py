"""Sparse MLP blocks of the MoE models (transformers' `Qwen3VLMoeTextSparseMoeBlock` and
`Qwen3_5MoeSparseMoeBlock`): a router picks each token's top-k experts and normalises their
weights; Qwen3.5's add a shared expert scaled by a sigmoid gate.

The experts' weights are 3-D, as transformers holds them: gate_up_proj [E, 2I, H] and down_proj
[E, H, I]; the kernel plan chooses how they are computed (mmcli/kernels/experts.py)."""

from __future__ import annotations

import re

import torch
from torch import nn

from mmcli.errors import CheckpointError
from mmcli.kernels.experts import grouped_experts, grouped_loop
from mmcli.models.config import TextConfig
from mmcli.models.layers.linear import Linear
from mmcli.models.layers.mlp import MLP, SiluAndMul
from mmcli.models.layers.quantized import Int4Weight, int4_linear


def int4_expert_ffn(
    weights: tuple[Int4Weight, Int4Weight, Int4Weight], act: SiluAndMul, x: torch.Tensor
) -> torch.Tensor:
    gate, up, down = weights
    return int4_linear(act(int4_linear(x, gate, None), int4_linear(x, up, None)), down, None)


class Experts(nn.Module):
    work = "experts"  # the kind of work the kernel plan installs a kernel for
    # (x, chosen, weights, gate_up_proj, down_proj) -> y, or None where they are not the kernel's
    kernel = None
    int4: list[tuple[Int4Weight, Int4Weight, Int4Weight]] | None = None  # gate, up, down each

    def __init__(self, cfg: TextConfig):
        super().__init__()
        experts, hidden, inner = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * inner, hidden))
        self.down_proj = nn.Parameter(torch.empty(experts, hidden, inner))
        self.act = SiluAndMul()

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
            experts, act = self.int4, self.act
            return grouped_loop(
                x,
                chosen,
                weights,
                len(experts),
                lambda e, rows: int4_expert_ffn(experts[e], act, rows),
            )
        held = (self.gate_up_proj, self.down_proj)
        if self.kernel is not None and (y := self.kernel(x, chosen, weights, *held)) is not None:
            return y
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


def mlp_for(cfg: TextConfig, index: int) -> nn.Module:
    """Decoder layer `index`'s MLP in an MoE model: sparse in the sparse layers."""
    if cfg.is_sparse(index):
        return SparseMoeBlock(cfg)
    return MLP(cfg.hidden_size, cfg.intermediate_size)


EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
PROJECTIONS = {"gate_up": ("gate", "up"), "down": ("down",)}  # the held tensors' parts
_HELD = re.compile(r"(.*\.mlp\.experts)\.(gate_up|down)_proj$")
_PER_EXPERT = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


def held_experts(name: str) -> tuple[str, str] | None:
    """(the experts' prefix, "gate_up" or "down") for a 3-D experts tensor as held, else None."""
    match = _HELD.match(name)
    return (match.group(1), match.group(2)) if match else None


def is_per_expert(name: str) -> bool:
    """Whether `name` is one expert's projection, as `save_pretrained` writes Qwen3.5 MoE."""
    return _PER_EXPERT.match(name) is not None


def experts_prefix(name: str) -> str | None:
    """The experts' prefix of an experts tensor, held or one expert's, else None."""
    match = _HELD.match(name) or _PER_EXPERT.match(name)
    return match.group(1) if match else None


def held_name(prefix: str, projection: str) -> str:
    return f"{prefix}.{projection}_proj"


def per_expert_names(prefix: str, count: int, projection: str) -> list[list[str]]:
    """Each expert's tensor names of one held projection ("gate_up": gate then up)."""
    parts = PROJECTIONS[projection]
    return [[f"{prefix}.{e}.{p}_proj.weight" for p in parts] for e in range(count)]


def experts_as_held(tensors: dict[str, torch.Tensor], expected: dict[str, tuple]) -> None:
    """The MoE experts as the model holds them (gate_up_proj [E, 2I, H], down_proj [E, H, I]),
    from any layout transformers loads: those shapes, the released checkpoints' transposed ones
    ([E, H, 2I], [E, I, H]; told apart by shape), or one tensor per expert and projection
    (`experts.{e}.gate_proj.weight` ..., as `save_pretrained` writes Qwen3.5 MoE). In place."""
    for name, shape in expected.items():
        if not name.endswith(EXPERTS):
            continue
        held = tensors.get(name)
        if held is not None:
            if tuple(held.shape) != shape and tuple(held.shape) == (shape[0], shape[2], shape[1]):
                tensors[name] = held.transpose(1, 2).contiguous()
            continue
        prefix, projection = held_experts(name)
        per_expert = per_expert_names(prefix, shape[0], projection)
        if not any(n in tensors for names in per_expert for n in names):
            continue  # missing: named by the check that follows
        missing = [n for names in per_expert for n in names if n not in tensors]
        if missing:
            raise CheckpointError(f"missing expert tensors: {', '.join(missing[:3])}")
        tensors[name] = torch.stack(
            [torch.cat([tensors.pop(n) for n in names]) for names in per_expert]
        )
