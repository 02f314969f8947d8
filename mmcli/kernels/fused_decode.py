"""A decode step of up to KERNEL_ROWS sequences through a dense decoder in one kernel call a layer
(cpu.decode_layer, decode_layer.c): for Qwen3-VL's attention layers with bfloat16 weights
computing in float32 on the CPU, the default precision there. Any other layer, batch or backend
keeps the decoder's modules (models/qwen3_vl/text.py), which this reproduces operation for
operation (tests/test_fused_decode.py compares the two). It reads the layers by their attributes:
the kernels import no model."""

from __future__ import annotations

import torch

from mmcli.kernels import cpu
from mmcli.kernels.cpu_ops import KERNEL_ROWS


def _matrix(linear) -> bool:
    weight = getattr(linear, "weight", None)
    return (
        getattr(linear, "work", None) == "upcast"  # a Linear as loaded, not a quantized form
        and isinstance(weight, torch.Tensor)
        and weight.dtype == torch.bfloat16
        and weight.is_contiguous()
        and linear.bias is None
    )


def _norm(norm) -> bool:
    return (
        not norm.unit_offset and norm.weight.dtype == torch.float32 and norm.weight.is_contiguous()
    )


def _fusable(layer, rotary_dim: int) -> bool:
    if layer.linear or not hasattr(layer.mlp, "gate_proj"):  # Gated DeltaNet, MoE
        return False
    attn, mlp = layer.self_attn, layer.mlp
    linears = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj]
    linears += [mlp.gate_proj, mlp.up_proj, mlp.down_proj]
    norms = [layer.input_layernorm, layer.post_attention_layernorm, attn.q_norm, attn.k_norm]
    return (
        not attn.output_gate
        and rotary_dim == attn.head_dim
        and all(map(_matrix, linears))
        and all(map(_norm, norms))
    )


class FusedDecode:
    """The decoder's layers as decode_layer.c's structs; `tiles`: their products in bfloat16 on
    the AMX tiles (up to cpu.AMX_ROWS rows), else float32 FMAs (up to KERNEL_ROWS)."""

    def __init__(self, layers, eps: float, tiles: bool = False):
        self.max_rows = cpu.AMX_ROWS if tiles else KERNEL_ROWS
        self.layers, self._weights = [], []  # the structs, and the tensors they point into
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            weights = {
                "input_norm": layer.input_layernorm.weight,
                "post_norm": layer.post_attention_layernorm.weight,
                "q_norm": attn.q_norm.weight,
                "k_norm": attn.k_norm.weight,
                **{name: getattr(attn, f"{name}_proj").weight for name in "qkvo"},
                **{name: getattr(mlp, f"{name}_proj").weight for name in ("gate", "up", "down")},
            }
            self._weights.append(weights)
            self.layers.append(
                cpu.DecodeLayer(
                    **{name: tensor.data_ptr() for name, tensor in weights.items()},
                    hidden=layer.input_layernorm.weight.shape[0],
                    heads=attn.num_heads,
                    kv_heads=attn.num_kv_heads,
                    d=attn.head_dim,
                    intermediate=mlp.gate_proj.out_features,
                    eps=eps,
                    tiles=int(tiles),
                )
            )

    @classmethod
    def for_decoder(cls, decoder, cfg=None, tiles: bool = False) -> FusedDecode | None:
        """The fused step for `decoder` (a TextDecoder with its weights in their form; `cfg` its
        TextConfig, the decoder's own by default), or None where a layer, its weights or this
        machine do not fit it. `tiles`: as the class's."""
        cfg = cfg or decoder.cfg
        if cpu.load()[0] is None or decoder.norm.weight.device.type != "cpu":
            return None
        if not all(_fusable(layer, cfg.rotary_dim) for layer in decoder.layers):
            return None
        return cls(decoder.layers, cfg.rms_norm_eps, tiles and cpu.name() == "AMX")

    def fits(self, hidden: torch.Tensor, batch, deepstack) -> bool:
        """A decode step of the kernels' few rows, eager, in float32 on the CPU."""
        return (
            batch.seqlens is None
            and not batch.fixed_shapes
            and 1 <= batch.slots.shape[0] <= self.max_rows
            and batch.slots.device.type == "cpu"
            and deepstack is None
            and hidden.dtype == torch.float32
            and cpu.eager()
        )

    def __call__(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch, cache
    ) -> torch.Tensor:
        """hidden [B, H] -> the last layer's output [B, H] (the final norm is the caller's)."""
        slots, positions = (t.to(torch.int64).contiguous() for t in (batch.slots, batch.positions))
        first, last = int(positions.min()), int(positions.max())
        if not (0 <= first and last < cache.columns):  # the kernel writes at these unchecked
            raise IndexError(
                f"decode positions {positions.tolist()} outside the cache's {cache.columns} columns"
            )
        if not (0 <= int(slots.min()) and int(slots.max()) < cache.rows):
            raise IndexError(f"cache rows {slots.tolist()} outside its {cache.rows} rows")
        x = hidden.clone(memory_format=torch.contiguous_format)
        cos, sin = cos.contiguous(), sin.contiguous()  # float32, as hidden (TextDecoder casts)
        scratch = cpu.decode_scratch(self.layers[0], x.shape[0], last + 1)
        for i, layer in enumerate(self.layers):
            # [rows, kv_heads, columns, d], contiguous (DecoderCache)
            kv = cache.layer(i)
            cpu.decode_layer(layer, x, kv, slots, positions, cos, sin, scratch)
        return x


def fusable_config(text) -> bool:
    """Whether a decoder of this TextConfig has only layers decode_layer.c computes: attention
    without an output gate, rotary over whole heads, plain RMSNorms, dense MLPs."""
    return (
        not text.layer_types
        and not text.num_experts
        and not text.attn_output_gate
        and not text.norm_unit_offset
        and text.rotary_dim == text.head_dim
    )
