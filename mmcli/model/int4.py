"""4-bit weights: a scale and a zero point per group of GROUP input channels (asymmetric), held in
the layout torch's int4 CPU kernel takes and computed by it
(`torch.ops.aten._weight_int4pack_mm_for_cpu`, bfloat16 activations, float32 accumulation).

Half a byte a parameter, plus 4 bytes of scale and zero per group. The kernel is faster than
float32's GEMM for a few rows (decode) and slower for many (prefill): bench/moe.py measures both."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

GROUP = 32  # input channels per scale and zero: the error against int8's is in docs/models.md


@dataclass
class Int4Weight:
    packed: torch.Tensor  # torch's int4 CPU layout of the [out, in] 4-bit values
    scales_zeros: torch.Tensor  # [in / GROUP, out, 2] bfloat16
    shape: tuple[int, int]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales_zeros))


def can_int4() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and hasattr(
        torch.ops.aten, "_convert_weight_to_int4pack_for_cpu"
    )


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


def int4_linear(x: torch.Tensor, weight: Int4Weight, bias: torch.Tensor | None) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, weight.packed, GROUP, weight.scales_zeros)
    y = y.to(x.dtype)
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], weight.shape[0])
