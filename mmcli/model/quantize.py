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

from mmcli.model.linear import Linear, quantize_linears
from mmcli.model.moe import SparseMoeBlock


@torch.no_grad()
def fold_norm(norm: nn.Module, linears: list[Linear]) -> None:
    """Move `norm`'s scale (and bias, for LayerNorm) into the linears that read its output; a
    norm scaling by 1 + weight (Qwen3.5) is left scaling by 1."""
    offset = float(getattr(norm, "unit_offset", False))
    scale = norm.weight.detach().float() + offset
    shift = norm.bias.detach().float() if getattr(norm, "bias", None) is not None else None
    for linear in linears:
        weight = linear.weight.detach().float()
        if shift is not None:
            extra = weight @ shift
            linear.bias = nn.Parameter(
                extra if linear.bias is None else linear.bias.float() + extra, requires_grad=False
            )
        # float32, quantized right after
        linear.weight = nn.Parameter(weight * scale, requires_grad=False)
    norm.weight.fill_(1.0 - offset)
    if shift is not None:
        norm.bias.zero_()


def quantize_model(model: nn.Module) -> int:
    """Fold the decoder's and the vision blocks' norms, then int8 for every linear but a tied
    lm_head (which stays the embedding's bfloat16). Returns how many linears were quantized."""
    text = model.language_model
    for layer in text.layers:  # layer by layer: one layer's folded float32 weights at a time
        fold_norm(layer.input_layernorm, _mixer_inputs(layer))
        if isinstance(layer.mlp, SparseMoeBlock):  # the router and the 3-D experts stay as loaded
            quantize_linears(layer, keep=(layer.mlp.gate,))
            continue
        fold_norm(layer.post_attention_layernorm, [layer.mlp.gate_proj, layer.mlp.up_proj])
        quantize_linears(layer)
    for block in model.visual.blocks:
        fold_norm(block.norm1, [block.attn.qkv])
        fold_norm(block.norm2, [block.mlp.linear_fc1])
        quantize_linears(block)
    # load_state_dict(assign=True) makes two Parameters over one storage: tied means the same memory
    tied = (
        model.lm_head.weight.untyped_storage().data_ptr()
        == text.embed_tokens.weight.untyped_storage().data_ptr()
    )
    quantize_linears(model, keep=(model.lm_head,) if tied else ())
    return sum(isinstance(m, Linear) and m.kernel == "int8" for m in model.modules())


def _mixer_inputs(layer: nn.Module) -> list[Linear]:
    """The linears reading a decoder layer's input norm: attention's q/k/v, or Gated DeltaNet's
    four input projections."""
    if layer.linear:
        mixer = layer.linear_attn
        return [mixer.in_proj_qkv, mixer.in_proj_z, mixer.in_proj_b, mixer.in_proj_a]
    return [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj]
