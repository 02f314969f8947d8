"""The model built from a checkpoint's weights, and its weights put into the form the kernel plan
chose (oneDNN's packed float32, int8 through the prepared cache, int4's blocks form), the
plan's kernels installed."""

from __future__ import annotations

import torch
from torch import nn

from mmcli.kernels.host_memory import hold_in_huge_pages, keep_freed_memory, populate
from mmcli.kernels.plan import (
    INT4,
    INT4_BLOCKS,
    INT8,
    ONEDNN_INT8,
    PACKED,
    KernelPlan,
    hand_on_norms,
    install,
    int8_head,
)
from mmcli.kernels.weight_forms import int4_block
from mmcli.models.config import ModelConfig
from mmcli.models.layers.linear import Linear, PackedLinear, can_pack
from mmcli.models.layers.quantized import Int8Linear
from mmcli.models.registry import family_of
from mmcli.weights import int4
from mmcli.weights.checkpoint import Weights
from mmcli.weights.int8 import as_rows, quantize_model, replace
from mmcli.weights.prepared import PreparedWeights


def build_model(cfg: ModelConfig, weights: Weights) -> nn.Module:
    """Built without allocating, then given the loaded tensors (a tied lm_head shares
    embed_tokens) and any 4-bit weights."""
    with torch.device("meta"):
        model = family_of(cfg).build(cfg)
    quantized = bool(weights.int4 or weights.experts_int4)
    model.load_state_dict(weights.tensors, strict=not quantized, assign=True)
    int4.adopt(model, weights.int4, weights.experts_int4)
    return model.eval().requires_grad_(False)


def pack_linears(model: nn.Module) -> int:
    """Every Linear of `model` that can be (CPU, float32, oneDNN present) replaced by its
    PackedLinear; returns how many were."""
    names = [
        name
        for name, m in model.named_modules()
        if isinstance(m, Linear) and m.weight is not None and can_pack(m.weight)
    ]
    for name in names:
        replace(model, name, PackedLinear(model.get_submodule(name)))
    return len(names)


def vision_int8(tower: nn.Module, rows: bool) -> int:
    """The vision tower's int8 layers given the kernel plan's `vision_int8`, in rows layout for
    oneDNN's int8 GEMM where it is that; returns how many."""
    layers = [m for m in tower.modules() if isinstance(m, Int8Linear)]
    for layer in layers:
        layer.work = "vision_int8"
        if rows:
            layer.weight = as_rows(layer.weight)
    return len(layers)


def quantize(
    model: nn.Module, prepared: PreparedWeights | None, within: nn.Module | None = None
) -> None:
    """int8 for `model` (`within` that module only): through the prepared file where the cache
    is on."""
    if prepared is not None:
        prepared.quantize(model, within)
    else:
        quantize_model(model, within=within)


def prepare(
    model: nn.Module,
    plan: KernelPlan,
    device: torch.device,
    prepared: PreparedWeights | None,
    huge_pages: bool = False,
) -> nn.Module:
    """The weights in the plan's form on `device`, its kernels installed, and on the CPU the
    allocator set for the run and the weights' pages mapped in, or (`huge_pages`) copied into
    anonymous memory in 2 MiB pages before the kernels take their addresses."""
    model = model.to(device)
    form = plan.linears.id
    if form == INT8:
        quantize(model, prepared)
    elif form == INT4 and (scopes := int4_int8_scopes(model, plan)):
        quantize(model, prepared.int8 if prepared is not None else None, scopes)
    elif form == PACKED:
        pack_linears(model)
    if plan.vision_int8.install is not None:
        vision_int8(model.visual, rows=plan.vision_int8.id == ONEDNN_INT8)
    if plan.int4.form == INT4_BLOCKS:
        int4.in_blocks(model, int4_block())
    moved = device.type == "cpu" and huge_pages and hold_in_huge_pages(held_tensors(model))
    install(plan, model)
    hand_on_norms(plan, family_of(model.cfg).fold_groups(model))
    if device.type == "cpu":
        keep_freed_memory()  # after the load: its temporaries are returned as before
        if not moved:
            populate([(t.data_ptr(), t.numel() * t.element_size()) for t in held_tensors(model)])
    return model


def int4_int8_scopes(model: nn.Module, plan: KernelPlan) -> nn.ModuleList | None:
    """What an int4 run holds in int8 (its decoder is int4 as read): the vision tower where the
    plan has an int8 kernel for it, and a tied lm_head (left as loaded by the read: the
    embedding's table) where the plan holds the head in int8; None where neither."""
    scopes = [model.visual] if plan.vision_int8.install is not None else []
    if int8_head(plan) and type(model.lm_head) is Linear:
        scopes.append(model.lm_head)
    return nn.ModuleList(scopes) if scopes else None


def held_tensors(model: nn.Module) -> list[torch.Tensor]:
    """The tensors the model computes with on the CPU: parameters, buffers and the quantized and
    packed layers' weights (oneDNN's packed ones are opaque: no pages of ours to map)."""
    tensors = [*model.parameters(), *model.buffers(), *held_extras(model)]
    return [t for t in tensors if t.device.type == "cpu" and t.layout == torch.strided]


def held_extras(model: nn.Module) -> list[torch.Tensor]:
    """The quantized and packed layers' own weights (their `held`), beside the parameters."""
    return [t for layer in model.modules() if hasattr(layer, "held") for t in layer.held()]


def held_bytes(model: nn.Module) -> int:
    """Bytes the model's weights take as held: the extents of its parameters, buffers and
    quantized and packed layers' weights, each byte once (a tied weight is shared; weights held
    in huge pages share one storage), plus the MoE experts' int4."""
    tensors = [*model.parameters(), *model.buffers(), *held_extras(model)]
    tensors = [t for t in tensors if t.device.type != "meta" and t.numel()]
    opaque = [t for t in tensors if t.layout != torch.strided]  # oneDNN's packed: no address
    extents = sorted(
        (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
        for t in tensors
        if t.layout == torch.strided
    )
    total, reached = sum(t.numel() * t.element_size() for t in opaque), 0
    for start, end in extents:
        total += max(0, end - max(start, reached))
        reached = max(reached, end)
    return total + sum(getattr(m, "int4_bytes", 0) for m in model.modules())  # MoE experts
