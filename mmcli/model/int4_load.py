"""`quantize: int4` at load: each matrix is quantized as it is read, so no full-precision copy of
the model is ever held (a 30B MoE's experts are most of its bytes).

Quantized: every linear layer's weight of the text decoder (and an untied lm_head) whose shape
torch's int4 CPU kernel takes (rows a multiple of 16, columns of GROUP) and the MoE experts, one
expert's gate, up and down projections at a time; kept as loaded: the vision tower, the
embeddings, the norms, the MoE routers and a tied lm_head."""

from __future__ import annotations

import re

import torch

from mmcli.errors import CheckpointError
from mmcli.model.int4 import GROUP, Int4Weight, Slab, quantize_int4

_PER_EXPERT = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
_FUSED = re.compile(r"(.*\.mlp\.experts)\.(gate_up|down)_proj$")


def eligible(name: str, shape: tuple[int, ...], linear_weights: set[str], tied: bool) -> bool:
    """Whether int4 takes this tensor: a linear layer's or an expert's [out, in] matrix whose
    sides the kernel takes (out a multiple of 16, in of GROUP), not a router or a tied head."""
    if name.endswith(".mlp.gate.weight") or (tied and name == "lm_head.weight"):
        return False
    # The vision tower stays as stored (llama.cpp keeps its mmproj in 16 bits too): a few percent
    # of the parameters, and its many rows a call run faster in float32 than in torch's int4 kernel.
    if name.startswith("model.visual."):
        return False
    if "embed" in name:  # embed_tokens, the vision patch and position embeddings
        return False
    if not (_PER_EXPERT.match(name) or _FUSED.match(name) or name in linear_weights):
        return False
    out, inner = shape[-2:]
    if (fused := _FUSED.match(name)) and fused.group(2) == "gate_up":
        out = min(out, inner) // 2  # each of gate and up, whichever way the tensor is laid out
    return out % 16 == 0 and min(shape[-2:]) % GROUP == 0 and max(shape[-2:]) % GROUP == 0


def quantize_read(name: str, tensor: torch.Tensor, expected: tuple[int, ...] | None, slab: Slab):
    """The int4 form of one tensor as read, held in `slab`: an Int4Weight, or for a fused experts
    tensor (either orientation) a list per expert of (gate, up) or (down,) Int4Weights."""
    fused = _FUSED.match(name)
    if fused is None:
        return quantize_int4(tensor, slab)
    if expected is not None and tuple(tensor.shape) != expected:
        tensor = tensor.transpose(1, 2)  # the released [E, in, out] layout
    if fused.group(2) == "down":
        return [(quantize_int4(e, slab),) for e in tensor]
    half = tensor.shape[1] // 2
    return [(quantize_int4(e[:half], slab), quantize_int4(e[half:], slab)) for e in tensor]


def experts_int4(held: dict, expected: dict[str, tuple]) -> dict[str, list]:
    """Per MoE layer (`...mlp.experts`), each expert's (gate, up, down) Int4Weights, from the fused
    or the per-expert tensors read; what it used is taken out of `held`."""
    out = {}
    for name, shape in expected.items():
        fused = _FUSED.match(name)
        if fused is None or fused.group(2) != "gate_up":
            continue
        prefix, count = fused.group(1), shape[0]
        down = held.pop(f"{prefix}.down_proj", None)
        gate_up = held.pop(name, None)
        if gate_up is None or down is None:
            names = [
                f"{prefix}.{e}.{p}_proj.weight"
                for e in range(count)
                for p in "gate up down".split()
            ]
            missing = [n for n in names if n not in held]
            if len(missing) == len(names):
                continue  # named by the missing-tensor check
            if missing:
                raise CheckpointError(f"missing expert tensors: {', '.join(missing[:3])}")
            parts = [held.pop(n) for n in names]
            out[prefix] = [tuple(parts[3 * e : 3 * e + 3]) for e in range(count)]
        else:
            out[prefix] = [g_u + d for g_u, d in zip(gate_up, down)]
    return out


def adopt(model: torch.nn.Module, held: dict[str, Int4Weight], experts: dict[str, list]) -> None:
    """Put the 4-bit weights into the model built on the meta device."""
    for name, weight in held.items():
        module = model.get_submodule(name.rsplit(".", 1)[0])
        module.packed_weight, module.weight, module.kernel = weight, None, "int4"
    for prefix, weights in experts.items():
        model.get_submodule(prefix).adopt_int4(weights)
