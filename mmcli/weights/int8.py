"""int8 for both towers: norm scales folded into the linear layers that read them, then every
linear quantized.

A norm's per-channel scale makes channel outliers (a few channels many times larger than the
rest, as large language models show); folding it into the next linear's weight columns (W' = W
diag(g), b' = b + W beta) takes those channels out of the activations before they are quantized,
exactly in real arithmetic. The weights then get a scale per output channel, so a large column
costs only its own rows' precision."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from mmcli.kernels import cpu
from mmcli.kernels.host_memory import release_freed_memory
from mmcli.models.layers.linear import Linear
from mmcli.models.layers.quantized import Int8Head, Int8Linear, Int8Weight
from mmcli.models.registry import family_of


def _padded(size: int, multiple: int) -> int:
    return -(-size // multiple) * multiple


def quantize_int8(
    weight: torch.Tensor, bias: torch.Tensor | None = None, column_scale: torch.Tensor | None = None
) -> Int8Weight:
    """Symmetric int8 with one scale per output channel (largest magnitude -> 127), in the
    kernel's layout, of weight * column_scale (a folded norm's scale, one per input column) where
    one is given. By int8_weights.c from the stored weights where it builds (the same bits)."""
    out_features, in_features = weight.shape
    n, k = _padded(out_features, 16), _padded(in_features, 4)
    full_bias = torch.zeros(n)
    if bias is not None:
        full_bias[:out_features] = bias.detach().float()
    if column_scale is not None:
        column_scale = column_scale.detach().float().contiguous()
    if (
        weight.device.type == "cpu"
        and weight.dtype in (torch.bfloat16, torch.float32)
        and cpu.load()[0] is not None
    ):
        values, scale, sums = cpu.quantize_weights(
            weight.detach().contiguous(), column_scale, (n, k)
        )
        return Int8Weight(values=values, scale=scale, sums=sums, bias=full_bias)
    w = weight.detach().float()
    if column_scale is not None:
        w = w * column_scale
    scale = torch.zeros(n)
    scale[:out_features] = torch.maximum(w.amax(1), w.amin(1).neg()).div_(127).clamp_min_(1e-12)
    rows = torch.zeros(n, k, dtype=torch.int8)
    rows[:out_features, :in_features] = w.div(scale[:out_features, None]).round_()
    return Int8Weight(
        values=rows.view(n // 16, 16, k // 4, 4).permute(0, 2, 1, 3).reshape(n, k),
        scale=scale,
        sums=rows.sum(1, dtype=torch.int32),
        bias=full_bias,
    )


def int8_layout(linear: nn.Linear) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The shape and dtype of each of a layer's Int8Weight tensors: its sides padded for the
    kernel."""
    n, k = _padded(linear.out_features, 16), _padded(linear.in_features, 4)
    return {
        "values": ((n, k), torch.int8),
        "scale": ((n,), torch.float32),
        "sums": ((n,), torch.int32),
        "bias": ((n,), torch.float32),
    }


def int8_linear(
    linear: Linear,
    prepared: dict[str, torch.Tensor] | None = None,
    column_scale: torch.Tensor | None = None,
) -> Int8Linear:
    """The int8 form of `linear` (and the bias beside it), quantized from its weight alone (times
    `column_scale`, a folded norm's, where given; no float32 copy of the model is made), or as
    `prepared` holds it from an earlier run. The logits' linear (its work "head") becomes an
    Int8Head."""
    if prepared is None:
        weight = quantize_int8(linear.weight, linear.bias, column_scale)
    else:
        weight = Int8Weight(**prepared)
    head = getattr(linear, "work", None) == "head"
    return (Int8Head if head else Int8Linear)(linear.in_features, linear.out_features, weight)


def replace(model: nn.Module, name: str, module: nn.Module) -> None:
    """Put `module` where the submodule `name` is (gpt-fast's swap: the layer's quantized form is
    a module of its own)."""
    parent, _, child = name.rpartition(".")
    model.get_submodule(parent).register_module(child, module)


def quantize_linears(model: nn.Module, keep: tuple[nn.Module, ...] = ()) -> int:
    """int8 for every Linear of `model` but those in `keep`, no norm folded (what the tests
    compare folding against)."""
    names = [n for n, m in model.named_modules() if isinstance(m, Linear) and m not in keep]
    for name in names:
        replace(model, name, int8_linear(model.get_submodule(name)))
    return len(names)


def _float_product(weight: torch.Tensor, vector: torch.Tensor, rows: int = 256) -> torch.Tensor:
    """weight @ vector in float32, a block of rows at a time: a float32 copy of each whole weight
    mapped fresh memory at every linear (3 of a 2B vision tower's 3.9 s of folding)."""
    return torch.cat([block.float() @ vector for block in weight.split(rows)])


@torch.no_grad()
def fold_norm(
    norm: nn.Module, linears: list[Linear], into_linears: bool = True, quantize: bool = False
) -> list[Int8Linear]:
    """Move `norm`'s scale (and bias, for LayerNorm) into the linears that read its output; a
    norm scaling by 1 + weight (Qwen3.5) is left scaling by 1. Without `into_linears` the norm
    only: the linears' folded values come prepared from an earlier run. With `quantize`, each
    linear is quantized to int8 with the scale applied on the way (no float32 copy of its
    weight), returned in the order of `linears`."""
    offset = float(getattr(norm, "unit_offset", False))
    quantized = []
    scale = norm.weight.detach().float() + offset
    shift = norm.bias.detach().float() if getattr(norm, "bias", None) is not None else None
    for linear in linears if into_linears else []:
        weight = linear.weight.detach()
        if not quantize:
            weight = weight.float()  # one float32 copy, for the folded weight
        if shift is not None:
            extra = _float_product(weight, shift)
            linear.bias = nn.Parameter(
                extra if linear.bias is None else linear.bias.float() + extra, requires_grad=False
            )
        if quantize:  # from the stored weight; the caller puts it in the model
            quantized.append(int8_linear(linear, column_scale=scale))
        else:
            linear.weight = nn.Parameter(weight * scale, requires_grad=False)
    norm.weight.fill_(1.0 - offset)
    if shift is not None:
        norm.bias.zero_()
    return quantized


def int8_linears(model: nn.Module, within: nn.Module | None = None) -> dict[str, Linear]:
    """The linears int8 takes, by name: all but those its family keeps as loaded (an MoE's
    routers; the experts, 3-D, stay as loaded too), a tied lm_head included (an int8 copy: the
    embedding keeps its table); with `within` (an int4 run's vision tower and tied head), only
    those inside it."""
    keep = family_of(model.cfg).kept_linears(model)
    inside = set(within.modules()) if within is not None else None
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, Linear)
        and module not in keep
        and (inside is None or module in inside)
    }


def quantize_model(
    model: nn.Module, prepared: dict[str, dict] | None = None, within: nn.Module | None = None
) -> int:
    """Fold the norms into the linears that read them (the family's fold groups: the decoder's
    and the vision blocks'), each quantized as it is folded, then int8 for every other linear of
    int8_linears, scope by scope; with `prepared` (int8_linears' names to what int8_linear takes)
    the values are packed as given; with `within`, that module's scopes and linears only. Each
    Linear is replaced by its Int8Linear. Returns how many linears were quantized."""
    targets = {module: name for name, module in int8_linears(model, within).items()}
    inside = set(within.modules()) if within is not None else None
    fold = prepared is None

    def fold_into(norm: nn.Module, linears: list[Linear]) -> None:
        for linear, quantized in zip(linears, fold_norm(norm, linears, fold, quantize=True)):
            replace(model, targets.pop(linear), quantized)

    def quantize(scope: nn.Module) -> None:
        for module in [m for m in scope.modules() if m in targets]:
            name = targets.pop(module)
            replace(model, name, int8_linear(module, None if prepared is None else prepared[name]))

    count = len(targets)
    for scope, groups in family_of(model.cfg).fold_groups(model):
        if inside is not None and scope not in inside:
            continue
        for norm, linears in groups:
            fold_into(norm, linears)
        quantize(scope)
        if fold:  # the scope's float32 temporaries, freed between its int8 weights
            release_freed_memory()
    quantize(model)
    return count


def as_rows(weight: Int8Weight) -> Int8Weight:
    """The same weights in rows layout, for oneDNN's int8 GEMM (one copy at load: its packed
    form cannot be stored, and plain rows are what it reads fastest after it)."""
    return dataclasses.replace(weight, values=weight.rows().contiguous(), layout="rows")
