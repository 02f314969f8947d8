"""The linear layer of both towers as the checkpoint holds it, and its float32 form packed for
oneDNN. Quantized forms are modules of their own (quantized.py); the kernel plan chooses which
form each layer takes at load (mmcli/weights) and installs the kernels they call.

- Linear: weights as loaded. Held in a lower precision than the activations (bfloat16 weights,
  float32 compute: the CPU's default), the installed kernel widens them in registers
  (bf16_linear.c); without one, each chunk of output rows is converted to float32 in a reused
  buffer that stays in cache, then multiplied (MKL's kernel choice depends on the orientation, so
  the product is taken as x @ chunk.T or (chunk @ x.T).T by row count). A bfloat16 value converts
  to float32 exactly, so the numbers are those of the float32 path up to the order of the sums.
  In a run of bfloat16 products (matrix.bf16_products) a layer whose output only feeds the next
  product takes `rounded` and hands it on in bfloat16, as that product would round it.
- PackedLinear: float32 weights reordered once into oneDNN's blocked layout (`torch.ops.mkldnn`,
  the ops Inductor emits for CPU linears); `dtype: float32` runs this.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# output rows converted per chunk: 4 MB of float32 for a 2048-wide layer, cache resident
UPCAST_ROWS = 512
_scratch: dict[tuple, torch.Tensor] = {}
ACTIVATIONS = (None, "gelu_tanh")  # what a Linear can apply to its output (GELU's tanh form)


def activate(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    """`activation` (one of ACTIVATIONS) applied to a linear's output."""
    return y if activation is None else F.gelu(y, approximate="tanh")


def check_activation(activation: str | None) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"linear activation {activation!r}: not one of {ACTIVATIONS}")


def upcast_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str | None = None,
) -> torch.Tensor:
    """activation(x @ weight.T + bias) with a weight held in a lower precision than x, converted
    chunk by chunk into a reused buffer."""
    x2 = x.reshape(-1, x.shape[-1])
    rows = x2.shape[0]
    key = (weight.shape[1], x.dtype, x.device)
    if key not in _scratch:
        # a normal tensor: writable inside inference mode and out of it
        with torch.inference_mode(False):
            _scratch[key] = torch.empty(
                UPCAST_ROWS, weight.shape[1], dtype=x.dtype, device=x.device
            )
    buffer = _scratch[key]
    # MKL picks a faster kernel as (chunk @ x.T).T for these row counts (bench/cpu.py)
    transposed = rows == 1 or 16 <= rows < 128
    xt = x2.t().contiguous() if transposed else x2
    outs = []
    for start in range(0, weight.shape[0], UPCAST_ROWS):
        chunk = buffer[: min(UPCAST_ROWS, weight.shape[0] - start)]
        chunk.copy_(weight[start : start + UPCAST_ROWS])
        outs.append(chunk @ xt if transposed else x2 @ chunk.t())
    y = torch.cat(outs, 0).t() if transposed else torch.cat(outs, 1)
    if bias is not None:
        y = y + bias
    return activate(y, activation).reshape(*x.shape[:-1], weight.shape[0])


class Linear(nn.Linear):
    """nn.Linear as loaded: PyTorch's product (on the CPU in float32, 2-16 rows as weight @ x.T,
    where MKL takes a GEMV-like kernel), or with a lower-precision weight the installed kernel or
    upcast_linear."""

    work = "upcast"  # the kind of work the kernel plan installs a kernel for
    kernel = None  # (x, weight, bias, activation) -> y, or None where they are not the kernel's

    def reset_parameters(self) -> None:
        # built on the meta device and handed the checkpoint's tensors: the random start values
        # would be discarded (and cost half the build of a model's module tree)
        if not self.weight.is_meta:
            super().reset_parameters()

    def forward(
        self, x: torch.Tensor, activation: str | None = None, rounded: bool = False
    ) -> torch.Tensor:
        """x @ W.T + b, then `activation` (None or "gelu_tanh"), fused into the kernel where it
        can be. `rounded`: the output may come in bfloat16, rounded as a next bfloat16 product
        rounds its input: a run of bfloat16 products hands a GEMM's outputs on that way, one
        pass fewer for the same values (matrix.bf16_linear), and x may be such an output."""
        check_activation(activation)
        handed_on = x.dtype == self.weight.dtype == torch.bfloat16 and self.kernel is not None
        if self.weight.dtype != x.dtype or handed_on:
            if self.kernel is not None:
                y = self.kernel(x, self.weight, self.bias, activation, rounded)
                if y is not None:
                    return y
            x = x.float() if handed_on else x
            return upcast_linear(x, self.weight, self.bias, activation)
        if (
            x.device.type != "cpu"
            or x.dim() != 2
            or not 1 < x.shape[0] <= 16
            or x.dtype != torch.float32
        ):
            return activate(super().forward(x), activation)
        y = (self.weight @ x.t()).t()
        return activate(y if self.bias is None else y + self.bias, activation)


def can_pack(weight: torch.Tensor) -> bool:
    # The ops torch's own Inductor emits for CPU linears; checked, not assumed (a build without
    # oneDNN lacks them).
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


class PackedLinear(nn.Module):
    """A float32 Linear with its weight in oneDNN's blocked layout (the hint of 16 rows measured
    as good as any from 2 rows to 1000s); the plain weight is freed unless shared (a tied
    lm_head's is the embedding's)."""

    def __init__(self, linear: Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 16)
        self.bias = linear.bias

    def held(self) -> list[torch.Tensor]:
        """The tensors this layer computes with beyond its parameters."""
        return [self.packed_weight]

    def forward(
        self, x: torch.Tensor, activation: str | None = None, rounded: bool = False
    ) -> torch.Tensor:
        """As Linear's, in float32 (`rounded` or not)."""
        check_activation(activation)
        post, algorithm = ("gelu", "tanh") if activation else ("none", "")
        return torch.ops.mkldnn._linear_pointwise(
            x, self.packed_weight, self.bias, post, [], algorithm
        )


def embedding(count: int, width: int) -> nn.Embedding:
    """An nn.Embedding left uninitialised, as its values always come from the checkpoint: the
    random initialisation, even on the meta device, imports torch._dynamo (a second or more of
    every load)."""
    return nn.Embedding(count, width, _weight=torch.empty(count, width))
