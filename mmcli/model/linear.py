"""The linear layer of both towers, and the CPU kernels it runs with (the runner's
`prepare_weights` picks one for the model):

- packed: float32 weights reordered once into oneDNN's blocked layout (`torch.ops.mkldnn`, the ops
  Inductor emits for CPU linears); `dtype: float32` runs this.
- upcast: weights held in the checkpoint's bfloat16 and computed in float32 by our compiled kernels
  (cpu_kernel.py): up to KERNEL_ROWS rows (decode) the weights widened in registers, more rows
  (prefill, vision) a GEMM that widens them a panel at a time. Without the kernels, each chunk of
  output rows is converted to float32 in a reused buffer that stays in cache, then multiplied (MKL's
  kernel choice depends on the orientation, so the product is taken as x @ chunk.T or
  (chunk @ x.T).T by row count). A bfloat16 value converts to float32 exactly, so the numbers are
  those of the float32 path up to the order of the sums.
- int8: 8-bit weights with a scale per output channel, in the layout our kernel reads
  (int8_linear.c), so that they load as stored (fbgemm's packed weights cannot be stored, and
  packing them took longer than the rest of a one-image ask); activations quantized on the fly to
  7 bits with a scale per token, so a token with large values never coarsens the others.

bench/cpu.py prints what each kernel gives on the machine it runs on (docs/performance.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mmcli.model import cpu_kernel
from mmcli.model.int4 import int4_linear, quantize_int4

# the few-rows kernel up to here, the GEMM above: their crossover (bench/float_kernels.py)
KERNEL_ROWS = 16
# output rows converted per chunk: 4 MB of float32 for a 2048-wide layer, cache resident
UPCAST_ROWS = 512
_scratch: dict[tuple, torch.Tensor] = {}


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


ACTIVATIONS = (None, "gelu_tanh")  # what a Linear can apply to its output (GELU's tanh form)


def activate(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    """`activation` (one of ACTIVATIONS) applied to a linear's output."""
    return y if activation is None else F.gelu(y, approximate="tanh")


def upcast_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str | None = None,
) -> torch.Tensor:
    """activation(x (float32) @ weight.T + bias) with a lower-precision weight: a bfloat16 weight
    by the compiled kernels (cpu_kernel.py: up to KERNEL_ROWS rows the few-rows one, more rows
    the GEMM, which applies the bias and activation as it stores), where they load; otherwise
    converted chunk by chunk into a reused buffer."""
    x2 = x.reshape(-1, x.shape[-1])
    rows = x2.shape[0]
    if (
        weight.dtype == torch.bfloat16
        and x.dtype == torch.float32
        and weight.is_contiguous()
        and x.device.type == "cpu"
        and cpu_kernel.load()[0] is not None
    ):
        if rows > KERNEL_ROWS:
            y = cpu_kernel.bf16_gemm(x2.contiguous(), weight, bias, activation)
        else:
            y = cpu_kernel.bf16_linear(x2.contiguous(), weight)
            y = activate(y if bias is None else y + bias, activation)
        return y.reshape(*x.shape[:-1], weight.shape[0])
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


@dataclass
class Int8Weight:
    """A layer's int8 weights in the kernel's layout (int8_linear.c: groups of 16 output channels,
    4 input channels interleaved; out_features padded to 16, in_features to 4 with zeros), as
    computed and as the prepared file stores them: the kernel runs them as they are."""

    values: torch.Tensor  # int8 [padded out, padded in], in the kernel's order
    scale: torch.Tensor  # float32 per output channel (zero for padding)
    sums: torch.Tensor  # int32: each output channel's sum of values
    bias: torch.Tensor  # float32 (zeros when the layer has none)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"values": self.values, "scale": self.scale, "sums": self.sums, "bias": self.bias}

    def rows(self) -> torch.Tensor:
        """The values as [padded out, padded in] rows (a strided view of the kernel's layout)."""
        n, k = self.values.shape
        return self.values.view(n // 16, k // 4, 16, 4).permute(0, 2, 1, 3).reshape(n, k)


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
        and cpu_kernel.load()[0] is not None
    ):
        values, scale, sums = cpu_kernel.quantize_weights(
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


def _rows_buffer(shape: torch.Size) -> torch.Tensor:
    """A float32 [rows, columns] buffer reused across calls (one per width, grown to the most
    rows seen): a fresh one of a prefill's size is mapped and page-faulted at every call."""
    rows, columns = shape
    held = _scratch.get(("rows", columns))
    if held is None or held.shape[0] < rows:
        with torch.inference_mode(False):  # a normal tensor: writable in and out of it
            held = _scratch[("rows", columns)] = torch.empty(rows, columns)
    return held[:rows]


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


def int8_kernel_name() -> str:
    library, reason = cpu_kernel.load()
    if library is None:
        return f"int8 in float32 ({reason})"
    return f"int8_linear.c ({cpu_kernel.name()})"


# activations take 7 bits (-63..63): the kernel's AVX2 path multiplies them without saturating
X_MAX = 63


def int8_linear(
    x: torch.Tensor, weight: Int8Weight, out_features: int, per_token: bool = True
) -> torch.Tensor:
    """x @ W.T with the activations quantized on the fly, each row with its own scale (or one
    for the call without `per_token`), summed exactly in int32 by int8_linear.c where it builds,
    else by the same arithmetic in float32 (exact while the sums stay under 2**24)."""
    x2 = x.reshape(-1, x.shape[-1]).float().contiguous()
    if per_token and cpu_kernel.load()[0] is not None:
        y = cpu_kernel.int8_linear(x2, weight)
    else:
        scale = torch.maximum(x2.amax(1, keepdim=True), x2.amin(1, keepdim=True).neg_())
        if not per_token:
            scale = scale.amax().expand(x2.shape[0], 1)
        scale = scale.div(X_MAX).clamp_min_(1e-12)
        levels = torch.div(x2, scale, out=_rows_buffer(x2.shape)).round_()
        padded = torch.nn.functional.pad(levels, (0, weight.values.shape[1] - x2.shape[1]))
        y = upcast_linear(padded, weight.rows(), None).mul_(scale).mul_(weight.scale)
        y.add_(weight.bias)
    if y.shape[1] != out_features:
        y = y[:, :out_features]
    return y.to(x.dtype).reshape(*x.shape[:-1], out_features)


class Linear(nn.Linear):
    """nn.Linear whose kernel the runner's `prepare_weights` chooses: packed (oneDNN float32),
    upcast (bfloat16 weight, float32 compute), int8 (int8_linear.c), or plain (PyTorch's; on the
    CPU in float32, 2-16 rows as weight @ x.T, where MKL takes a GEMV-like kernel)."""

    kernel = "plain"
    packed_weight = None  # oneDNN's blocked float32 weight, an Int8Weight or int4's
    per_token = True

    def reset_parameters(self) -> None:
        # built on the meta device and handed the checkpoint's tensors: the random start values
        # would be discarded (and cost half the build of a model's module tree)
        if not self.weight.is_meta:
            super().reset_parameters()

    def pack(self) -> None:
        """Reorder the weight into oneDNN's blocked layout (the hint of 16 rows measured as good
        as any from 2 rows to 1000s) and drop this module's plain weight: it is freed unless
        shared (a tied lm_head's is the embedding's)."""
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), 16)
        self.weight, self.kernel = None, "packed"

    def quantize(
        self,
        prepared: dict[str, torch.Tensor] | None = None,
        column_scale: torch.Tensor | None = None,
    ) -> None:
        """int8 weights (and the bias beside them), quantized from this layer's weight alone
        (times `column_scale`, a folded norm's, where given; no float32 copy of the model is
        made), or as `prepared` holds them from an earlier run."""
        if prepared is None:
            self.packed_weight = quantize_int8(self.weight, self.bias, column_scale)
        else:
            self.packed_weight = Int8Weight(**prepared)
        self.weight, self.bias, self.kernel = None, None, "int8"

    def quantize_int4(self) -> None:
        """4-bit weights with a scale and zero per group of input channels (model/int4.py)."""
        self.packed_weight = quantize_int4(self.weight)
        self.weight, self.kernel = None, "int4"

    def forward(self, x: torch.Tensor, activation: str | None = None) -> torch.Tensor:
        """x @ W.T + b, then `activation` (None or "gelu_tanh"), fused into the kernel where it
        can be (oneDNN's packed linear, the bfloat16 GEMM)."""
        if activation not in ACTIVATIONS:
            raise ValueError(f"linear activation {activation!r}: not one of {ACTIVATIONS}")
        if self.kernel == "packed":
            post, algorithm = ("gelu", "tanh") if activation else ("none", "")
            return torch.ops.mkldnn._linear_pointwise(
                x, self.packed_weight, self.bias, post, [], algorithm
            )
        if self.kernel == "plain" and self.weight.dtype != x.dtype:
            return upcast_linear(x, self.weight, self.bias, activation)
        return activate(self._unfused(x), activation)

    def _unfused(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel == "int4":
            return int4_linear(x, self.packed_weight, self.bias)
        if self.kernel == "int8":
            return int8_linear(x, self.packed_weight, self.out_features, self.per_token)
        if (
            x.device.type != "cpu"
            or x.dim() != 2
            or not 1 < x.shape[0] <= 16
            or x.dtype != torch.float32
        ):
            return super().forward(x)
        y = (self.weight @ x.t()).t()
        return y if self.bias is None else y + self.bias


def embedding(count: int, width: int) -> nn.Embedding:
    """An nn.Embedding left uninitialised, as its values always come from the checkpoint: the
    random initialisation, even on the meta device, imports torch._dynamo (a second or more of
    every load)."""
    return nn.Embedding(count, width, _weight=torch.empty(count, width))


def pack_linears(model: nn.Module) -> int:
    """Pack every Linear of `model` that can be (CPU, float32, oneDNN present); returns how many
    were."""
    layers = [
        m
        for m in model.modules()
        if isinstance(m, Linear) and m.weight is not None and can_pack(m.weight)
    ]
    for layer in layers:
        layer.pack()
    return len(layers)


def quantize_linears(model: nn.Module, keep: tuple[nn.Module, ...] = ()) -> int:
    """int8 for every Linear of `model` but those in `keep` (a tied lm_head stays the embedding's
    bfloat16)."""
    layers = [
        m
        for m in model.modules()
        if isinstance(m, Linear) and m.weight is not None and m not in keep
    ]
    for layer in layers:
        layer.quantize()
    return len(layers)


def held_tensors(model: nn.Module) -> list[torch.Tensor]:
    """The tensors the model computes with on the CPU: parameters, buffers and int8 weights."""
    tensors = [t for t in [*model.parameters(), *model.buffers()] if t.device.type == "cpu"]
    for layer in model.modules():
        if isinstance(layer, Linear) and layer.kernel == "int8":
            tensors += layer.packed_weight.tensors().values()
    return tensors


def held_bytes(model: nn.Module) -> int:
    """Bytes the model's weights take as held: every tensor's storage once (a tied weight is
    shared), plus the packed oneDNN, int8 and int4 weights."""
    storages = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.device.type != "meta":
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    total = sum(storages.values())
    for layer in model.modules():
        if isinstance(layer, Linear) and layer.kernel == "packed":
            total += layer.packed_weight.numel() * layer.packed_weight.element_size()
        elif isinstance(layer, Linear) and layer.kernel == "int8":
            total += sum(t.nbytes for t in layer.packed_weight.tensors().values())
        elif isinstance(layer, Linear) and layer.kernel == "int4":
            total += layer.packed_weight.nbytes
    total += sum(getattr(m, "int4_bytes", 0) for m in model.modules())  # MoE experts
    return total
