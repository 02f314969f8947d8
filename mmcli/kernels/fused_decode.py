"""A decode step of a few sequences through a dense decoder in one kernel call a layer
(cpu.decode_layer, decode_layer.c): for attention layers with bfloat16 weights (the default
precision on the CPU), int8 ones (int8_linear.c's layout) or int4 ones (torch's layout, where
the build has int4_vnni.c), computing in float32. Any other
layer, batch or backend keeps the decoder's modules, which this reproduces operation for
operation (tests/test_fused_decode.py compares the two). The decoder hands its layers over as
FusableLayer: the kernels import no model."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mmcli.kernels import cpu
from mmcli.kernels.cpu_ops import KERNEL_ROWS
from mmcli.kernels.weight_forms import Int4Weight, Int8Weight

NORMS = ("input_norm", "post_norm", "q_norm", "k_norm")
MATRICES = ("q", "k", "v", "o", "gate", "up", "down")


@dataclass(frozen=True)
class FusableLayer:
    """One decoder layer in decode_layer.c's terms: its RMSNorms (NORMS) and linears (MATRICES)
    by the struct's names, and its attention's shape."""

    norms: dict[str, torch.nn.Module]
    linears: dict[str, torch.nn.Module]
    heads: int
    kv_heads: int
    head_dim: int
    output_gate: bool

    def fits(self, rotary_dim: int) -> bool:
        """Whether the kernel computes this layer with its weights in their present form."""
        return (
            not self.output_gate
            and rotary_dim == self.head_dim
            and any(all(map(form, self.linears.values())) for form in (_bf16, _int8, _int4))
            and all(map(_norm, self.norms.values()))
        )

    def int8(self) -> bool:
        return all(map(_int8, self.linears.values()))

    def int4(self) -> bool:
        return all(map(_int4, self.linears.values()))

    def tensors(self) -> dict[str, dict[str, torch.Tensor] | torch.Tensor]:
        """The norms' weights, and each matrix's tensors by decode_matrix's names."""
        norms = {name: module.weight for name, module in self.norms.items()}
        return norms | {name: _matrix(linear) for name, linear in self.linears.items()}


def _matrix(linear) -> dict[str, torch.Tensor]:
    if isinstance(linear.weight, Int8Weight):
        return {name: getattr(linear.weight, name) for name in ("values", "sums", "scale", "bias")}
    if isinstance(linear.weight, Int4Weight):
        return {"values": linear.weight.packed, "scales_zeros": linear.weight.scales_zeros}
    return {"values": linear.weight}


def _int4_blocks(linear) -> int:
    """decode_matrix's int4_blocks: an Int4Weight in the blocks form (Int4Weight.in_blocks)."""
    return int(getattr(linear.weight, "layout", "") == "blocks")


def _bf16(linear) -> bool:
    weight = getattr(linear, "weight", None)
    return (
        getattr(linear, "work", None) == "upcast"  # a Linear as loaded, not a quantized form
        and isinstance(weight, torch.Tensor)
        and weight.dtype == torch.bfloat16
        and weight.is_contiguous()
        and linear.bias is None
    )


def _int8(linear) -> bool:
    """An Int8Linear in int8_linear.c's layout whose padding is none (the kernel's rows are the
    layer's)."""
    weight = getattr(linear, "weight", None)
    return (
        getattr(linear, "work", None) == "int8"
        and isinstance(weight, Int8Weight)
        and weight.layout == "interleaved"
        and linear.per_token
        and tuple(weight.values.shape) == (linear.out_features, linear.in_features)
        and all(t.is_contiguous() for t in weight.tensors().values())
    )


def _int4(linear) -> bool:
    """An Int4Linear without a bias in shapes int4_vnni.c takes (blocks of 64 channels, groups of
    32 inputs), on a build that has it and reads its scales and zeros as they are laid out."""
    weight = getattr(linear, "weight", None)
    library = cpu.load()[0]
    return (
        getattr(linear, "work", None) == "int4"
        and isinstance(weight, Int4Weight)
        and linear.bias is None
        and weight.shape[0] % 64 == 0
        and weight.shape[1] % 32 == 0
        and weight.packed.is_contiguous()
        and weight.scales_zeros.is_contiguous()
        and library is not None
        and library.int4_vnni
        and (weight.layout == "torch" or library.int4_blocks)
    )


def _flat(tensors) -> list[torch.Tensor]:
    return [
        t for entry in tensors for t in (entry.values() if isinstance(entry, dict) else [entry])
    ]


def _norm(norm) -> bool:
    return (
        not norm.unit_offset and norm.weight.dtype == torch.float32 and norm.weight.is_contiguous()
    )


class FusedDecode:
    """The decoder's layers as decode_layer.c's structs; `bf16_products`: bfloat16 products up to
    cpu.AMX_ROWS rows (on the AMX tiles, else AVX-512 BF16's dot products: cpu.bf16_rows_linear),
    else float32 FMAs (up to `float_rows`, the plan's: KERNEL_ROWS by default). int8 layers take
    up to cpu.AMX_ROWS rows on int8_linear.c, as a layer-by-layer step does (its AMX build on the
    tiles above `int8_vnni_rows` rows); int4 layers from `int4_torch_rows` + 1 rows (fewer are
    torch's int4 kernel's) to cpu.AMX_ROWS on int4_vnni.c (its AMX build's tiles above
    `int4_vnni_rows`); each layer is of its own form (a decoder may keep some layers' linears
    unquantized)."""

    def __init__(
        self,
        layers: list[FusableLayer],
        eps: float,
        bf16_products: bool = False,
        int4_torch_rows: int = cpu.INT4_TORCH_ROWS,
        int8_vnni_rows: int = cpu.INT8_VNNI_ROWS,
        int4_vnni_rows: int = cpu.INT4_VNNI_ROWS,
        float_rows: int = KERNEL_ROWS,
    ):
        quantized = all(layer.int8() or layer.int4() for layer in layers)
        self.max_rows = cpu.AMX_ROWS if bf16_products or quantized else float_rows
        int4 = any(layer.int4() for layer in layers)
        self.min_rows = int4_torch_rows + 1 if int4 else 1
        self.structs, self._tensors = [], []  # the structs, and the tensors they point into
        for layer in layers:
            int8, int4, tensors = layer.int8(), layer.int4(), layer.tensors()
            self._tensors.append(tensors)
            norms = {name: tensors[name].data_ptr() for name in layer.norms}
            matrices = {
                name: cpu.DecodeMatrix(
                    **{k: t.data_ptr() for k, t in tensors[name].items()},
                    int4_blocks=_int4_blocks(linear),
                )
                for name, linear in layer.linears.items()
            }
            self.structs.append(
                cpu.DecodeLayer(
                    **norms,
                    **matrices,
                    hidden=tensors["input_norm"].shape[0],
                    heads=layer.heads,
                    kv_heads=layer.kv_heads,
                    d=layer.head_dim,
                    intermediate=tensors["gate"]["values"].shape[0],
                    eps=eps,
                    bf16_products=int(bf16_products and not (int8 or int4)),
                    int8=int(int8),
                    vnni_rows=int8_vnni_rows,
                    int4=int(int4),
                    int4_vnni_rows=int4_vnni_rows,
                )
            )

    @classmethod
    def for_decoder(
        cls,
        decoder,
        cfg=None,
        bf16_products: bool = False,
        int4_torch_rows: int = cpu.INT4_TORCH_ROWS,
        int8_vnni_rows: int = cpu.INT8_VNNI_ROWS,
        int4_vnni_rows: int = cpu.INT4_VNNI_ROWS,
        float_rows: int = KERNEL_ROWS,
    ) -> FusedDecode | None:
        """The fused step for `decoder` (a family's `language_model`, its weights in their form;
        `cfg` its TextConfig, the decoder's own by default), or None where a layer, its weights
        or this machine do not fit it. `bf16_products`, `int4_torch_rows`, `int8_vnni_rows`,
        `int4_vnni_rows`, `float_rows`: as the class's, where this build has a kernel for them."""
        cfg = cfg or decoder.cfg
        layers = decoder.fusable_layers()
        if cpu.load()[0] is None or not layers:
            return None
        on_cpu = all(
            t.device.type == "cpu" for layer in layers for t in _flat(layer.tensors().values())
        )
        if not on_cpu or not all(layer.fits(cfg.rotary_dim) for layer in layers):
            return None
        bf16_products = bf16_products and cpu.name() in cpu.BF16_DOT_BUILDS
        return cls(
            layers,
            cfg.rms_norm_eps,
            bf16_products,
            int4_torch_rows=int4_torch_rows,
            int8_vnni_rows=int8_vnni_rows,
            int4_vnni_rows=int4_vnni_rows,
            float_rows=float_rows,
        )

    def fits(self, hidden: torch.Tensor, batch, deepstack) -> bool:
        """A decode step of the kernels' few rows, eager, in float32 on the CPU."""
        return (
            batch.seqlens is None
            and not batch.fixed_shapes
            and self.min_rows <= batch.slots.shape[0] <= self.max_rows
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
        scratch = cpu.decode_scratch(self.structs[0], x.shape[0], last + 1)
        for i, layer in enumerate(self.structs):
            # [rows, kv_heads, columns, d], contiguous (DecoderCache)
            kv = cache.layer(i)
            cpu.decode_layer(layer, x, kv, slots, positions, cos, sin, scratch)
        return x
