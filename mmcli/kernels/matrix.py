"""The library's kernels for the CPU's matrix engines, as the layers call them once the kernel
plan installs them (the contracts of cpu_ops.py: the layer's inputs in, its output out, or None
where the inputs are not the kernel's). All of them are oneDNN's, through torch: its bfloat16
GEMM (`F.linear` on bfloat16 operands: AMX-BF16, AVX-512 BF16, Arm's BFMMLA) and its int8 GEMM
(`torch._int_mm`: AMX-INT8, VNNI), each accumulating in float32 (its flash attention in bfloat16
is in attention.py, the experts' loop on its GEMM in experts.py). Activations enter and leave in
float32: the residual stream, the norms and the KV cache stay float32 (`products: bfloat16` in
the records)."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from mmcli.kernels import cpu, cpu_ops
from mmcli.kernels.weight_forms import (
    GROUP,
    X_MAX,
    Int4Weight,
    Int8Weight,
    int4_block,
    int8_levels,
)

INT4_TILE = 256  # output channels dequantized at a time: 1 MB of bfloat16 for 2048 inputs


def _library_rows(x: torch.Tensor, above: int) -> bool:
    """Whether a product of these rows is the library's (more than `above` rows, float32
    activations or bfloat16 ones handed on by a product before, eager: a graph being traced
    keeps torch's own operations)."""
    return (
        x.dtype in (torch.float32, torch.bfloat16)
        and x.device.type == "cpu"
        and x.numel() // x.shape[-1] > above
        and not torch.compiler.is_compiling()
    )


def bf16_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str | None,
    rounded: bool = False,
) -> torch.Tensor:
    """x (float32, or bfloat16 as a product before handed it on) @ weight.T (bfloat16) by
    oneDNN's bfloat16 GEMM: x rounded to bfloat16, the sums in float32, the result (rounded to
    bfloat16 by the GEMM) returned in float32 with the bias and the activation applied there (in
    one pass where our kernels run: pointwise.c). `rounded`: that result rounded to bfloat16 in
    the same pass, as the next product would round it; a float32 one where our kernels do not
    run."""
    y = F.linear(x.to(torch.bfloat16), weight)
    widened = cpu_ops.widen_outputs(y, bias, activation, rounded)
    if widened is not None:
        return widened
    y = y.float()
    if bias is not None:
        y += bias
    return y if activation is None else F.gelu(y, approximate="tanh")


def bf16_products(above: int, few_rows: bool = False):
    """The `upcast` kernel of a run with bfloat16 products: more than `above` rows on oneDNN's
    bfloat16 GEMM, fewer on bf16_linear.c (a few rows: decode reads each weight once, bound by
    memory) or, with `few_rows`, on this build's kernel for bfloat16 products of few rows, the
    AMX tiles or AVX-512 BF16's dot products (where bf16_linear.c's float32 FMAs fall behind the
    memory from 4 rows; at every row count, so that a row's products do not depend on how many
    share its step). The GEMM hands its outputs on `rounded` where asked; the few rows' kernels
    give float32, and take a handed-on input widened."""

    def matmul(x, weight, bias, activation, rounded=False):
        if weight.dtype == torch.bfloat16 and _library_rows(x, above):
            return bf16_linear(x, weight, bias, activation, rounded)
        x = x.float()
        if few_rows and bias is None and activation is None:
            return cpu_ops.bf16_rows_matmul(x, weight, split=False)
        return cpu_ops.bf16_matmul(x, weight, bias, activation)

    return matmul


def int8_rows_matmul(
    x2: torch.Tensor, weight: Int8Weight, activation: str | None = None
) -> torch.Tensor | None:
    """x2 (rows, in) float32 @ an Int8Weight in rows layout ([padded out, padded in]) by
    oneDNN's int8 GEMM (`torch._int_mm`), the sums exact in int32 on VNNI or AMX-INT8 (the plan
    takes it only there: cpu_features.exact_int8), so the result is int8_reference's with a
    scale a row; then the activation."""
    if weight.layout != "rows" or x2.device.type != "cpu" or torch.compiler.is_compiling():
        return None
    values, scale = int8_levels(x2, X_MAX)
    padded = weight.values.shape[1] - x2.shape[1]
    if padded:
        values = F.pad(values, (0, padded))
    sums = torch._int_mm(values, weight.values.t())
    y = sums.float().mul_(scale).mul_(weight.scale).add_(weight.bias)
    return y if activation is None else F.gelu(y, approximate="tanh")


_row_copies: dict[tuple[int, int], torch.Tensor] = {}


def rows_copy(weight: Int8Weight) -> Int8Weight:
    """The weight in rows layout, copied from int8_linear.c's into a buffer reused per shape:
    the decoder's weights are stored in ours, which decode reads."""
    n, k = weight.values.shape
    buffer = _row_copies.get((n, k))
    if buffer is None:
        with torch.inference_mode(False):  # a normal tensor: writable in and out of it
            buffer = _row_copies[n, k] = torch.empty(n, k, dtype=torch.int8)
    interleaved = weight.values.view(n // 16, k // 4, 16, 4).permute(0, 2, 1, 3)
    buffer.view(n // 16, 16, k // 4, 4).copy_(interleaved)
    return dataclasses.replace(weight, values=buffer, layout="rows")


def int8_products(above: int):
    """The decoder's `int8` kernel where oneDNN's int8 GEMM wins at many rows: above `above`
    rows the weights copied to rows layout for the call (one pass over them, which the rows
    amortize) and multiplied by oneDNN, fewer rows on int8_linear.c."""

    def matmul(x2: torch.Tensor, weight: Int8Weight, activation: str | None = None):
        if weight.layout == "interleaved" and _library_rows(x2, above):
            return int8_rows_matmul(x2, rows_copy(weight), activation)
        return cpu_ops.int8_matmul(x2, weight, activation)

    return matmul


def int4_dequantized(
    weight: Int4Weight, start: int, stop: int, block: int | None = None
) -> torch.Tensor:
    """Output channels [start, stop) (multiples of 64) of an Int4Weight as bfloat16 [in, stop -
    start] (torch's CPU int4 layout of `block` channels a block, this process's by default:
    each input's values of a block in block / 2 bytes, the low nibbles its first half), value =
    (q - 8) * scale + zero per GROUP inputs; int4_tiles.c's where our kernels run."""
    block = block or int4_block()
    weight = weight.torch_form()
    if cpu.eager() and weight.scales_zeros.is_contiguous():
        return cpu.int4_dequantize(weight, GROUP, start, stop, block)
    inner = weight.shape[1]
    packed = weight.packed.view(-1, inner, block // 2)[start // block : stop // block]
    q = torch.cat([packed & 0xF, packed >> 4], -1)  # [blocks, in, block]
    q = q.permute(1, 0, 2).reshape(inner // GROUP, GROUP, stop - start)
    scales_zeros = weight.scales_zeros[:, start:stop].float()  # [in / GROUP, out, 2]
    w = (q.float() - 8).mul_(scales_zeros[:, None, :, 0]).add_(scales_zeros[:, None, :, 1])
    return w.reshape(inner, stop - start).to(torch.bfloat16)


def int4_tiles_linear(
    x: torch.Tensor, weight: Int4Weight, bias: torch.Tensor | None, products: str = "bfloat16"
) -> torch.Tensor:
    """x @ W.T for an Int4Weight at many rows: INT4_TILE output channels at a time dequantized
    to bfloat16 and multiplied by oneDNN's GEMM in the run's `products` (torch's int4 kernel
    dequantizes every weight for every few rows): bfloat16 where the CPU multiplies it, else
    float32, x unrounded and the tile widened (exactly)."""
    dtype = torch.bfloat16 if products == "bfloat16" else torch.float32
    x2 = x.reshape(-1, x.shape[-1]).to(dtype)
    out = torch.empty(x2.shape[0], weight.shape[0], dtype=torch.float32)
    for start in range(0, weight.shape[0], INT4_TILE):
        stop = min(start + INT4_TILE, weight.shape[0])
        out[:, start:stop] = torch.mm(x2, int4_dequantized(weight, start, stop).to(dtype))
    if bias is not None:
        out += bias
    return out.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])


def int4_matmul(above: int | None, vnni_above: int | None = None, products: str = "bfloat16"):
    """The `int4` kernel: more than `above` rows (None: none) dequantized in tiles for oneDNN's
    GEMM in `products` (int4_tiles_linear), fewer on torch's int4 kernel (None: the layer's
    own), or on the int8 dot products (cpu_ops.int4_vnni_matmul) above `vnni_above` rows where
    that is given."""

    def matmul(x, weight, bias):
        tiles = above is not None and _library_rows(x, above)
        if weight.shape[0] % 64 == 0 and tiles:
            return int4_tiles_linear(x, weight, bias, products)
        if vnni_above is None:
            return None
        return cpu_ops.int4_vnni_matmul(x, weight, bias, vnni_above)

    return matmul
