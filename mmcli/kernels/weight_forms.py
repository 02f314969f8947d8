"""The quantized weights' forms as the kernels read them: Int8Weight (int8_linear.c's layout, or
plain rows for oneDNN's int8 GEMM) and Int4Weight (torch's int4 CPU layout), with the constants
of their arithmetic and the activations' levels (int8_levels). mmcli/weights makes them;
models/layers/quantized.py computes with them."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

# int4's input channels per scale and zero: the error against int8's is in docs/models.md
GROUP = 32
# int8's activations take 7 bits (-63..63): the kernel's AVX2 path multiplies them without
# saturating
X_MAX = 63


def int8_levels(x2: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row quantized to -levels..levels with its own scale: (int8 values, float32 scales
    [rows, 1]); the arithmetic of int8_reference."""
    scale = torch.maximum(x2.amax(1, keepdim=True), x2.amin(1, keepdim=True).neg_())
    scale = scale.div_(levels).clamp_min_(1e-12)
    return torch.div(x2, scale).round_().to(torch.int8), scale


def split_rows(x2: torch.Tensor) -> torch.Tensor:
    """x2 (rows, in) as twice the rows: each row on X_MAX levels of its own scale, then below them
    its rounding rest. They sum to x2; per-token levels take the first rows exactly and the rests
    to X_MAX levels of theirs (under half a level each), about 14 bits of each activation."""
    values, scale = int8_levels(x2, X_MAX)
    high = values.float().mul_(scale)
    return torch.cat([high, x2 - high])


def split_products(x2: torch.Tensor, products) -> torch.Tensor | None:
    """x2's products with each activation as two rows of 7-bit levels (split_rows), summed:
    `products` takes the split rows to (2 * rows, out), or None (then None)."""
    y = products(split_rows(x2))
    # summed into the first rows: a buffer of rows x out more would cost the logits' pages again
    return None if y is None else y[: x2.shape[0]].add_(y[x2.shape[0] :])


@dataclass
class Int8Weight:
    """A layer's int8 weights in the kernel's layout (int8_linear.c: groups of 16 output channels,
    4 input channels interleaved; out_features padded to 16, in_features to 4 with zeros), as
    computed and as the prepared file stores them: the kernel runs them as they are."""

    values: torch.Tensor  # int8 [padded out, padded in], in the kernel's order
    scale: torch.Tensor  # float32 per output channel (zero for padding)
    sums: torch.Tensor  # int32: each output channel's sum of values
    bias: torch.Tensor  # float32 (zeros when the layer has none)
    # "interleaved" (int8_linear.c's), or "rows": values as plain [padded out, padded in] rows,
    # the layout oneDNN's int8 GEMM reads (as_rows)
    layout: str = "interleaved"

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"values": self.values, "scale": self.scale, "sums": self.sums, "bias": self.bias}

    def rows(self) -> torch.Tensor:
        """The values as [padded out, padded in] rows (a strided view of the kernel's layout)."""
        if self.layout == "rows":
            return self.values
        n, k = self.values.shape
        return self.values.view(n // 16, k // 4, 16, 4).permute(0, 2, 1, 3).reshape(n, k)


@dataclass
class Int4Weight:
    """A layer's 4-bit weights in one of two forms: "torch" (as computed and stored: torch's int4
    CPU layout, each group's scale and zero in pairs by group) or "blocks" (the AVX2 build's
    kernels' form, made at load: `in_blocks`)."""

    packed: torch.Tensor  # the [out, in] 4-bit values, in torch's int4 CPU layout (int4_block)
    # "torch": [in / GROUP, out, 2] bfloat16, each group's pairs for every channel in a row;
    # "blocks": [out / block, in / GROUP, block, 2], each block's groups one after another
    scales_zeros: torch.Tensor
    shape: tuple[int, int]
    layout: str = "torch"

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"packed": self.packed, "scales_zeros": self.scales_zeros}

    def in_blocks(self, block: int) -> Int4Weight:
        """The same weights in the blocks form of `block` output channels (a copy at load), which
        the AVX2 kernels read without a shuffle: the scales and zeros by block (by group, each is
        a page from the last), and each 4 inputs' bytes of a block as quadruples (a byte's 4
        inputs side by side; torch's layout holds an input's bytes side by side). These where
        they are so, or their shape does not divide into blocks."""
        out, inner = self.shape
        if self.layout == "blocks" or out % block or inner % GROUP:
            return self
        pairs = self.scales_zeros.view(inner // GROUP, out // block, block, 2)
        pairs = pairs.transpose(0, 1).contiguous()
        quads = self.packed.view(out // block, inner // 4, 4, block // 2).transpose(2, 3)
        packed = quads.contiguous().view(self.packed.shape)
        return dataclasses.replace(self, packed=packed, scales_zeros=pairs, layout="blocks")

    def torch_form(self) -> Int4Weight:
        """These weights in torch's layout (a copy where they are in blocks): torch's int4 kernel
        and the dequantizers read them so."""
        if self.layout == "torch":
            return self
        out, inner = self.shape
        blocks, block = self.scales_zeros.shape[0], self.scales_zeros.shape[2]
        pairs = self.scales_zeros.transpose(0, 1).reshape(inner // GROUP, out, 2)
        values = self.packed.view(blocks, inner // 4, block // 2, 4).transpose(2, 3)
        packed = values.contiguous().view(self.packed.shape)
        return dataclasses.replace(self, packed=packed, scales_zeros=pairs, layout="torch")

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())


def int4_blocks(q: torch.Tensor, block: int) -> torch.Tensor:
    """q [out, in] (0..15) in torch's int4 CPU layout of `block` output channels a block: each
    input's values of a block in block / 2 bytes, the block's first half in the low nibbles."""
    out, inner = q.shape
    channels = q.reshape(out // block, block, inner).transpose(1, 2)  # [blocks, in, block]
    low, high = channels[..., : block // 2], channels[..., block // 2 :]
    return (low | high << 4).to(torch.uint8).reshape(out, inner // 2)


@functools.cache
def int4_block() -> int | None:
    """The output channels a block of torch's int4 CPU layout holds in this process, read once
    from torch's packer: it packs for the kernel it dispatches to, 64 on AVX-512 and 32 on AVX2
    (ATEN_CPU_CAPABILITY moves it); None for another layout. Our kernels and the C dequantizer
    read blocks of 64; a prepared file says which it holds."""
    q = torch.randint(0, 16, (128, 64), dtype=torch.int32, generator=torch.Generator())
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    return next((b for b in (64, 32) if torch.equal(packed, int4_blocks(q, b))), None)
