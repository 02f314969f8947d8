"""The MoE experts' kernels: tokens grouped by expert, so each expert's weights are read once per
call, for the tokens routed to it, and an expert no token chose is not read at all. A loop over
the chosen experts (a custom op, so compiled graphs call it as it is), the same loop on oneDNN's
bfloat16 GEMM for runs with bfloat16 products, and torch's grouped GEMM on CUDA."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mmcli.kernels.matrix import bf16_products


def expert_ffn(gate_up: torch.Tensor, down: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """One expert on the rows routed to it; weights held lower (bfloat16 on the CPU) compute in
    x's dtype."""
    gate, up = F.linear(x, gate_up.to(x.dtype)).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, down.to(x.dtype))


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
    gate_up: torch.Tensor,
    down: torch.Tensor,
) -> torch.Tensor:
    def ffn(expert: int, rows: torch.Tensor) -> torch.Tensor:
        return expert_ffn(gate_up[expert], down[expert], rows)

    return grouped_loop(x, chosen, weights, len(gate_up), ffn)


@grouped_experts.register_fake
def _(x, chosen, weights, gate_up, down):
    return torch.empty_like(x)


def grouped_gemm(x, chosen, weights, gate_up, down) -> torch.Tensor:
    """The same sum by torch's grouped GEMM (one kernel over every expert's rows, offsets kept on
    the device: no host sync). For CUDA with bfloat16 weights and activations."""
    rows, scales = _grouped(chosen, weights)
    counts = torch.bincount(chosen.flatten(), minlength=len(gate_up))
    offsets = counts.cumsum(0, dtype=torch.int32)
    grouped_mm = getattr(F, "grouped_mm", None) or torch._grouped_mm
    gate, up = grouped_mm(x[rows], gate_up.transpose(1, 2), offs=offsets).chunk(2, dim=-1)
    y = grouped_mm(F.silu(gate) * up, down.transpose(1, 2), offs=offsets)
    return torch.zeros_like(x).index_add_(0, rows, y * scales[:, None])


def has_grouped_gemm() -> bool:
    return hasattr(F, "grouped_mm") or hasattr(torch, "_grouped_mm")


def grouped_gemm_where_it_fits(x, chosen, weights, gate_up, down):
    """grouped_gemm for CUDA with bfloat16 weights and activations, else None."""
    if not (x.is_cuda and x.dtype == gate_up.dtype == torch.bfloat16):
        return None
    return grouped_gemm(x, chosen, weights, gate_up, down)


def bf16_grouped_experts(above: int):
    """The `experts` kernel of a run with bfloat16 products: each chosen expert's bfloat16
    weights multiplied as held, on its rows (more than `above`: oneDNN's bfloat16 GEMM; fewer:
    bf16_linear.c), where torch's loop converts each expert's weights to float32 per call."""
    matmul = bf16_products(above)

    def linear(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        y = matmul(rows, weight, None, None)
        return y if y is not None else F.linear(rows, weight.float())

    def experts(x, chosen, weights, gate_up, down):
        if x.dtype != torch.float32 or gate_up.dtype != torch.bfloat16:
            return None
        if x.device.type != "cpu" or torch.compiler.is_compiling():
            return None

        def ffn(expert: int, rows: torch.Tensor) -> torch.Tensor:
            gate, up = linear(rows, gate_up[expert]).chunk(2, dim=-1)
            return linear(F.silu(gate) * up, down[expert])

        return grouped_loop(x, chosen, weights, len(gate_up), ffn)

    return experts
