"""`quantize: int4` at load: each matrix is quantized as it is read, so no full-precision copy of
the model is ever held (a 30B MoE's experts are most of its bytes).

Quantized: every linear layer's weight of the text decoder (and an untied lm_head) whose shape
torch's int4 CPU kernel takes (rows a multiple of 16, columns of GROUP) and the MoE experts, one
expert's gate, up and down projections at a time; kept as loaded: the embeddings, the norms, the
MoE routers and a tied lm_head (the embedding's table). The vision tower and a tied lm_head are
read as stored and then held in int8 (weights/int8.py; the head as a copy beside the table) where
the kernel plan has an int8 kernel for them (weights/loader.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mmcli.errors import CheckpointError
from mmcli.models.layers.moe import (
    experts_prefix,
    held_experts,
    held_name,
    is_per_expert,
    per_expert_names,
)
from mmcli.models.layers.quantized import GROUP, Int4Linear, Int4Weight


def int4_values(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [out, in] in 0..15, scale, zero [out, in / GROUP]) with value = (q - 8) * scale + zero:
    each group's range mapped onto the 16 levels."""
    out, inner = weight.shape
    w = weight.detach().float().reshape(out, inner // GROUP, GROUP)
    low, high = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    scale = ((high - low) / 15).clamp_min(1e-8)
    q = ((w - low) / scale).round_().clamp_(0, 15).reshape(out, inner)
    return q.to(torch.int32), scale[..., 0], (low + 8 * scale)[..., 0]


ROWS = 2048  # quantized a block of rows at a time: a multiple of the kernel's 64-row blocks


class Slab:
    """The 4-bit weights of one load, carved out of large blocks. Thousands of sub-MiB weights
    allocated one by one between the quantizer's freed temporaries fragment malloc's heap (a
    30B MoE's load held 1.6x its weights); blocks this size are mapped apart from the heap."""

    def __init__(self, block_bytes: int = 256 << 20):
        self.block_bytes = block_bytes  # 0: each tensor allocated apart, at its own size
        self.block, self.used = torch.empty(0, dtype=torch.uint8), 0

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        nbytes = math.prod(shape) * dtype.itemsize
        start = -(-self.used // 64) * 64
        if start + nbytes > len(self.block):
            self.block, start = torch.empty(max(self.block_bytes, nbytes), dtype=torch.uint8), 0
        self.used = start + nbytes
        return self.block[start : start + nbytes].view(dtype).view(shape)


def quantize_int4(weight: torch.Tensor, slab: Slab | None = None) -> Int4Weight:
    """Row blocks pack exactly as the whole matrix would; quantizing a block at a time keeps the
    float32 and int32 temporaries small (the whole of a 151936-row lm_head's would be 4 GiB)."""
    out, inner = weight.shape
    slab = slab or Slab(0)
    packed = slab.take((out, inner // 2), torch.uint8)
    pairs = slab.take((inner // GROUP, out, 2), torch.bfloat16)
    for start in range(0, out, ROWS):
        q, scale, zero = int4_values(weight[start : start + ROWS])
        pairs[:, start : start + ROWS] = torch.stack([scale, zero], -1).transpose(0, 1)
        packed[start : start + ROWS] = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    return Int4Weight(packed, pairs, (out, inner))


def eligible(name: str, shape: tuple[int, ...], int4_names: frozenset[str], tied: bool) -> bool:
    """Whether int4 takes this tensor: one of `int4_names` (the decoder's linears but its
    family's kept ones, an untied lm_head, the experts as held) or one expert's projection, whose
    sides the kernel takes (out a multiple of 16, in of GROUP). The vision tower is not int4's:
    its many rows a call run faster in float32 than in torch's int4 kernel, and faster still on
    int8's kernels, which the load puts it on (weights/loader.py)."""
    if tied and name == "lm_head.weight":
        return False
    if name not in int4_names and not is_per_expert(name):
        return False
    out, inner = shape[-2:]
    if (held := held_experts(name)) and held[1] == "gate_up":
        out = min(out, inner) // 2  # each of gate and up, whichever way the tensor is laid out
    return out % 16 == 0 and min(shape[-2:]) % GROUP == 0 and max(shape[-2:]) % GROUP == 0


def quantize_read(name: str, tensor: torch.Tensor, expected: tuple[int, ...] | None, slab: Slab):
    """The int4 form of one tensor as read, held in `slab`: an Int4Weight, or for a held experts
    tensor (either orientation) a list per expert of (gate, up) or (down,) Int4Weights."""
    held = held_experts(name)
    if held is None:
        return quantize_int4(tensor, slab)
    if expected is not None and tuple(tensor.shape) != expected:
        tensor = tensor.transpose(1, 2)  # the released [E, in, out] layout
    if held[1] == "down":
        return [(quantize_int4(e, slab),) for e in tensor]
    half = tensor.shape[1] // 2
    return [(quantize_int4(e[:half], slab), quantize_int4(e[half:], slab)) for e in tensor]


def experts_int4(held: dict, expected: dict[str, tuple]) -> dict[str, list]:
    """Per MoE layer (by its experts' prefix), each expert's (gate, up, down) Int4Weights, from
    the held or the per-expert tensors read; what it used is taken out of `held`."""
    out = {}
    for name, shape in expected.items():
        experts = held_experts(name)
        if experts is None or experts[1] != "gate_up":
            continue
        prefix, count = experts[0], shape[0]
        down = held.pop(held_name(prefix, "down"), None)
        gate_up = held.pop(name, None)
        if gate_up is None or down is None:
            names = [
                n
                for gate_up_names, down_names in zip(
                    per_expert_names(prefix, count, "gate_up"),
                    per_expert_names(prefix, count, "down"),
                )
                for n in gate_up_names + down_names
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


PARTS = ("gate", "up", "down")  # an expert's projections as int4 holds them


@dataclass(frozen=True)
class Int4Shapes:
    """What a model's int4 weights are: each quantized matrix's [out, in], and per MoE layer (by
    its experts' prefix) the experts' count and gate/up [I, H] and down [H, I] shapes."""

    matrices: dict[str, tuple[int, int]]
    expert_groups: dict[str, tuple[int, tuple[int, int], tuple[int, int]]]

    @classmethod
    def of(cls, shapes: dict[str, tuple], int4_names: frozenset[str], tied: bool) -> Int4Shapes:
        """From the model's layout (every tensor's shape, the names int4 may take)."""
        matrices, experts = {}, {}
        for name in sorted(int4_names):
            shape = shapes[name]
            if not eligible(name, shape, int4_names, tied):
                continue
            held = held_experts(name)
            if held is None:
                matrices[name] = shape
            elif held[1] == "gate_up":
                count, double, hidden = shape
                experts[held[0]] = (count, (double // 2, hidden), (hidden, double // 2))
        return cls(matrices, experts)

    def covers(self, name: str) -> bool:
        """Whether a checkpoint tensor of this name ends up in these int4 weights."""
        return name in self.matrices or experts_prefix(name) in self.expert_groups


def as_tensors(matrices: dict[str, Int4Weight], experts: dict[str, list]) -> dict:
    """A load's 4-bit weights as named tensors (the prepared file holds these)."""
    weights = dict(matrices)
    for prefix, held in experts.items():
        for e, parts in enumerate(held):
            weights.update({f"{prefix}.{e}.{part}": w for part, w in zip(PARTS, parts)})
    tensors = {}
    for name, w in weights.items():
        tensors.update({f"{name}.{part}": t for part, t in w.tensors().items()})
    return tensors


def from_tensors(tensors: dict, shapes: Int4Shapes) -> tuple[dict, dict] | None:
    """The 4-bit weights (matrices by name, experts by prefix) of `as_tensors`'s tensors, or
    None where they are not those of `shapes`."""

    def weight(name: str, shape: tuple[int, int]) -> Int4Weight | None:
        packed, pairs = tensors.get(f"{name}.packed"), tensors.get(f"{name}.scales_zeros")
        if packed is None or pairs is None:
            return None
        form = (tuple(packed.shape), packed.dtype, tuple(pairs.shape), pairs.dtype)
        expected = ((shape[0], shape[1] // 2), torch.uint8)
        expected += ((shape[1] // GROUP, shape[0], 2), torch.bfloat16)
        return Int4Weight(packed, pairs, shape) if form == expected else None

    matrices = {name: weight(name, shape) for name, shape in shapes.matrices.items()}
    experts = {
        prefix: [
            tuple(weight(f"{prefix}.{e}.{part}", shape) for part, shape in zip(PARTS, sides))
            for e in range(count)
        ]
        for prefix, (count, gate, down) in shapes.expert_groups.items()
        for sides in [(gate, gate, down)]
    }
    every = [*matrices.values(), *(w for held in experts.values() for e in held for w in e)]
    if any(w is None for w in every) or 2 * len(every) != len(tensors):
        return None
    return matrices, experts


def adopt(model: torch.nn.Module, held: dict[str, Int4Weight], experts: dict[str, list]) -> None:
    """Put the 4-bit weights into the model built on the meta device."""
    for name, weight in held.items():
        path = name.rsplit(".", 1)[0]
        parent, _, child = path.rpartition(".")
        linear = model.get_submodule(path)
        model.get_submodule(parent).register_module(child, Int4Linear(weight, linear.bias))
    for prefix, weights in experts.items():
        model.get_submodule(prefix).adopt_int4(weights)


def in_blocks(model: torch.nn.Module, block: int) -> int:
    """Every Int4Linear in the blocks form of `block` output channels (the plan's INT4_BLOCKS:
    the kernels that read it), where its shape divides so; returns how many are."""
    count = 0
    for layer in model.modules():
        if isinstance(layer, Int4Linear):
            layer.weight = layer.weight.in_blocks(block)
            count += layer.weight.layout == "blocks"
    return count
