"""Quantized linear layers, each a module of its own that replaces a Linear at load
(mmcli/weights/int8.py and int4.py make their weights):

- Int8Linear: 8-bit weights with a scale per output channel, in the layout int8_linear.c reads
  (so that they load as stored: fbgemm's packed weights cannot be stored, and packing them took
  longer than the rest of a one-image ask); activations quantized on the fly to 7 bits with a
  scale per token, so a token with large values never coarsens the others. The logits'
  (Int8Head) take about 14 bits of each activation, as the bfloat16 head takes its activations
  as two bfloat16.
- Int4Linear: 4-bit weights with a scale and a zero point per group of GROUP input channels
  (asymmetric), in the layout torch's int4 CPU kernel takes and computed by it
  (`torch.ops.aten._weight_int4pack_mm_for_cpu`, bfloat16 activations, float32 accumulation).
  Half a byte a parameter, plus 4 bytes of scale and zero per group.
"""

from __future__ import annotations

import torch
from torch import nn

from mmcli.kernels.weight_forms import GROUP, X_MAX, Int4Weight, Int8Weight, split_products
from mmcli.models.layers.linear import activate, check_activation, upcast_linear

_rows: dict[int, torch.Tensor] = {}


def _rows_buffer(shape: torch.Size) -> torch.Tensor:
    """A float32 [rows, columns] buffer reused across calls (one per width, grown to the most
    rows seen): a fresh one of a prefill's size is mapped and page-faulted at every call."""
    rows, columns = shape
    held = _rows.get(columns)
    if held is None or held.shape[0] < rows:
        with torch.inference_mode(False):  # a normal tensor: writable in and out of it
            held = _rows[columns] = torch.empty(rows, columns)
    return held[:rows]


def int8_reference(x2: torch.Tensor, weight: Int8Weight, per_token: bool) -> torch.Tensor:
    """int8_linear.c's arithmetic in float32 (exact while the sums stay under 2**24): x2 (rows,
    in) quantized to X_MAX levels, each row with its own scale (or one for the call without
    `per_token`) -> (rows, padded out)."""
    scale = torch.maximum(x2.amax(1, keepdim=True), x2.amin(1, keepdim=True).neg_())
    if not per_token:
        scale = scale.amax().expand(x2.shape[0], 1)
    scale = scale.div(X_MAX).clamp_min_(1e-12)
    levels = torch.div(x2, scale, out=_rows_buffer(x2.shape)).round_()
    padded = torch.nn.functional.pad(levels, (0, weight.values.shape[1] - x2.shape[1]))
    y = upcast_linear(padded, weight.rows(), None).mul_(scale).mul_(weight.scale)
    return y.add_(weight.bias)


class Int8Linear(nn.Module):
    """x @ W.T + b with int8 weights, the activations quantized on the fly: by the installed
    kernel (int8_linear.c, summing exactly in int32), else int8_reference."""

    work = "int8"  # the kind of work the kernel plan installs a kernel for
    # (x2, Int8Weight, activation) -> activation((rows, padded out)), or None where x2 is not
    # the kernel's
    kernel = None
    per_token = True  # one activation scale a row; False: one a call (what the tests compare)

    def __init__(self, in_features: int, out_features: int, weight: Int8Weight):
        super().__init__()
        self.in_features, self.out_features, self.weight = in_features, out_features, weight

    def held(self) -> list[torch.Tensor]:
        """The tensors this layer computes with (no parameters: the Int8Weight's)."""
        return list(self.weight.tensors().values())

    def forward(
        self, x: torch.Tensor, activation: str | None = None, rounded: bool = False
    ) -> torch.Tensor:
        """As Linear's, in float32 (`rounded` or not)."""
        check_activation(activation)
        x2 = x.reshape(-1, x.shape[-1]).float().contiguous()
        y = self.products(x2, activation)
        if y.shape[1] != self.out_features:
            y = y[:, : self.out_features]
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def products(self, x2: torch.Tensor, activation: str | None) -> torch.Tensor:
        """activation(x2 @ W.T + b) as (rows, padded out)."""
        y = None
        if self.per_token and self.kernel is not None:
            y = self.kernel(x2, self.weight, activation)
        if y is None:
            y = activate(int8_reference(x2, self.weight, self.per_token), activation)
        return y


class Int8Head(Int8Linear):
    """The logits' Int8Linear: about 14 bits of each activation, where 7 bits would move every
    log-prob by twice what the int8 weights do. Its kernel (the plan's `head`) takes the float32
    rows, (x2, Int8Weight) -> (rows, padded out), or None; else each activation as two rows of
    7-bit levels (split_rows) in int8_reference, the products summed."""

    work = "head"
    kernel = None  # (x2, Int8Weight) -> (rows, padded out), or None where x2 is not its

    def products(self, x2: torch.Tensor, activation: str | None) -> torch.Tensor:
        y = self.kernel(x2, self.weight) if self.per_token and self.kernel is not None else None
        if y is None:
            y = split_products(x2, lambda split: int8_reference(split, self.weight, self.per_token))
        return activate(y, activation)


def can_int4() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and hasattr(
        torch.ops.aten, "_convert_weight_to_int4pack_for_cpu"
    )


def int4_linear(x: torch.Tensor, weight: Int4Weight, bias: torch.Tensor | None) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
    weight = weight.torch_form()
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, weight.packed, GROUP, weight.scales_zeros)
    y = y.to(x.dtype)
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], weight.shape[0])


class Int4Linear(nn.Module):
    """x @ W.T + b with 4-bit weights: the installed kernel where it takes the inputs (many rows
    dequantized for a bfloat16 GEMM), else torch's int4 kernel."""

    work = "int4"  # the kind of work the kernel plan installs a kernel for
    kernel = None  # (x, Int4Weight, bias) -> y, or None where the inputs are not the kernel's

    def __init__(self, weight: Int4Weight, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight, self.bias = weight, bias

    def held(self) -> list[torch.Tensor]:
        return list(self.weight.tensors().values())

    def forward(
        self, x: torch.Tensor, activation: str | None = None, rounded: bool = False
    ) -> torch.Tensor:
        """As Linear's, in float32 (`rounded` or not)."""
        check_activation(activation)
        y = self.kernel(x, self.weight, self.bias) if self.kernel is not None else None
        if y is None:
            y = int4_linear(x, self.weight, self.bias)
        return activate(y, activation)
