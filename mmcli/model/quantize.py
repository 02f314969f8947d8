"""int8 for both towers: norm scales folded into the linear layers that read them, then every
linear quantized.

A norm's per-channel scale makes channel outliers (a few channels many times larger than the
rest, as large language models show); folding it into the next linear's weight columns (W' = W
diag(g), b' = b + W beta) takes those channels out of the activations before they are quantized,
exactly in real arithmetic. The weights then get a scale per output channel, so a large column
costs only its own rows' precision."""

from __future__ import annotations

import torch
from torch import nn

from mmcli.model.host_memory import release_freed_memory
from mmcli.model.linear import Linear
from mmcli.model.moe import SparseMoeBlock


@torch.no_grad()
def fold_norm(
    norm: nn.Module, linears: list[Linear], into_linears: bool = True, quantize: bool = False
) -> None:
    """Move `norm`'s scale (and bias, for LayerNorm) into the linears that read its output; a
    norm scaling by 1 + weight (Qwen3.5) is left scaling by 1. Without `into_linears` the norm
    only: the linears' folded values come prepared from an earlier run. With `quantize`, each
    linear is quantized to int8 with the scale applied on the way (no float32 copy of its
    weight)."""
    offset = float(getattr(norm, "unit_offset", False))
    scale = norm.weight.detach().float() + offset
    shift = norm.bias.detach().float() if getattr(norm, "bias", None) is not None else None
    for linear in linears if into_linears else []:
        weight = linear.weight.detach()
        if shift is not None or not quantize:
            weight = weight.float()  # one float32 copy, for the shift and the folded weight
        if shift is not None:
            extra = weight @ shift
            linear.bias = nn.Parameter(
                extra if linear.bias is None else linear.bias.float() + extra, requires_grad=False
            )
        if quantize:  # from the stored weight
            linear.quantize(column_scale=scale)
        else:
            linear.weight = nn.Parameter(weight * scale, requires_grad=False)
    norm.weight.fill_(1.0 - offset)
    if shift is not None:
        norm.bias.zero_()


def int8_linears(model: nn.Module) -> dict[str, Linear]:
    """The linears int8 takes, by name: all but the MoE routers (the experts, 3-D, stay as
    loaded too) and a tied lm_head (which stays the embedding's bfloat16)."""
    text = model.language_model
    # load_state_dict(assign=True) makes two Parameters over one storage: tied means the same memory
    tied = (
        model.lm_head.weight is not None
        and model.lm_head.weight.untyped_storage().data_ptr()
        == text.embed_tokens.weight.untyped_storage().data_ptr()
    )
    keep = {model.lm_head} if tied else set()
    keep |= {layer.mlp.gate for layer in text.layers if isinstance(layer.mlp, SparseMoeBlock)}
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, Linear) and module not in keep
    }


def quantize_model(model: nn.Module, prepared: dict[str, dict] | None = None) -> int:
    """Fold the decoder's and the vision blocks' norms into the linears that read them, each
    quantized as it is folded, then int8 for every other linear of int8_linears, layer by layer;
    with `prepared` (int8_linears' names to what Linear.quantize takes) the values are packed as
    given. Returns how many linears were quantized."""
    targets = {module: name for name, module in int8_linears(model).items()}
    fold = prepared is None

    def quantize(scope: nn.Module) -> None:
        for module in scope.modules():
            if module in targets and module.kernel != "int8":
                module.quantize(None if prepared is None else prepared[targets[module]])

    for layer in model.language_model.layers:
        fold_norm(layer.input_layernorm, _mixer_inputs(layer), fold, quantize=True)
        if not isinstance(layer.mlp, SparseMoeBlock):
            mlp = layer.mlp
            fold_norm(layer.post_attention_layernorm, [mlp.gate_proj, mlp.up_proj], fold, True)
        quantize(layer)
        if fold:  # the layer's float32 temporaries, freed between its int8 weights
            release_freed_memory()
    for block in model.visual.blocks:
        fold_norm(block.norm1, [block.attn.qkv], fold, quantize=True)
        fold_norm(block.norm2, [block.mlp.linear_fc1], fold, quantize=True)
        quantize(block)
        if fold:
            release_freed_memory()
    quantize(model)
    return len(targets)


def _mixer_inputs(layer: nn.Module) -> list[Linear]:
    """The linears reading a decoder layer's input norm: attention's q/k/v, or Gated DeltaNet's
    four input projections."""
    if layer.linear:
        mixer = layer.linear_attn
        return [mixer.in_proj_qkv, mixer.in_proj_z, mixer.in_proj_b, mixer.in_proj_a]
    return [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj]
