"""The linear layer of both towers, and the CPU kernels it runs with (the runner's
`prepare_weights` picks one for the model):

- packed: float32 weights reordered once into oneDNN's blocked layout (`torch.ops.mkldnn`, the ops
  Inductor emits for CPU linears); `dtype: float32` runs this.
- upcast: weights held in the checkpoint's bfloat16 and computed in float32. Up to KERNEL_ROWS rows
  (decode), a compiled kernel widens the weights in registers (cpu_kernel.py); more rows (prefill,
  vision), or no kernel: each chunk of output rows is converted to float32 in a reused buffer that
  stays in cache, then multiplied. A bfloat16 value converts to float32 exactly, so the numbers are
  those of the float32 path. MKL's kernel choice depends on the orientation, so the product is taken
  as x @ chunk.T or (chunk @ x.T).T by row count.
- int8: 8-bit weights with a scale per output channel (fbgemm's packed weights) and dynamic 8-bit
  activations with a scale per token: each row is divided by its own largest magnitude before
  fbgemm's dynamic quantization (which takes one scale per call), so a token with large values never
  coarsens the others.

bench/cpu.py prints what each kernel gives on the machine it runs on (docs/performance.md).
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from mmcli.model import cpu_kernel
from mmcli.model.int4 import int4_linear, quantize_int4

# the crossover with the chunked path, from bench/cpu.py's kernel table
KERNEL_ROWS = 24
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


def can_quantize() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines and hasattr(
        torch.ops.quantized, "linear_dynamic"
    )


def upcast_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x (float32) @ weight.T with a lower-precision weight: up to KERNEL_ROWS rows of a bfloat16
    weight by the compiled kernel (cpu_kernel.py), where it loads; otherwise converted chunk by
    chunk into a reused buffer."""
    x2 = x.reshape(-1, x.shape[-1])
    rows = x2.shape[0]
    if (
        rows <= KERNEL_ROWS
        and weight.dtype == torch.bfloat16
        and x.dtype == torch.float32
        and weight.is_contiguous()
        and x.device.type == "cpu"
        and cpu_kernel.load()[0] is not None
    ):
        y = cpu_kernel.bf16_linear(x2.contiguous(), weight)
        y = y if bias is None else y + bias
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
    return y.reshape(*x.shape[:-1], weight.shape[0])


def quantize_int8(weight: torch.Tensor):
    """fbgemm's packed int8 weight with one scale per output channel (symmetric: largest
    magnitude -> 127)."""
    w = weight.detach().float()
    scale = (w.abs().amax(1) / 127).clamp_min(1e-12).double()
    zero = torch.zeros(w.shape[0], dtype=torch.long)
    # deprecated for new code, but fbgemm's prepack takes only a quantized tensor
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        q = torch.quantize_per_channel(w, scale, zero, 0, torch.qint8)
    return torch.ops.quantized.linear_prepack(q, None)


def pack_int8(values: torch.Tensor, scale: torch.Tensor):
    """fbgemm's packed weight from int8 values and their per-channel scales (as stored)."""
    zero = torch.zeros(len(scale), dtype=torch.long)
    q = torch._make_per_channel_quantized_tensor(values, scale, zero, 0)
    return torch.ops.quantized.linear_prepack(q, None)


def _rows_buffer(shape: torch.Size) -> torch.Tensor:
    """A float32 [rows, columns] buffer reused across calls (one per width, grown to the most
    rows seen): a fresh one of a prefill's size is mapped and page-faulted at every call."""
    rows, columns = shape
    held = _scratch.get(("rows", columns))
    if held is None or held.shape[0] < rows:
        with torch.inference_mode(False):  # a normal tensor: writable in and out of it
            held = _scratch[("rows", columns)] = torch.empty(rows, columns)
    return held[:rows]


def int8_linear(
    x: torch.Tensor, packed, out_features: int, bias: torch.Tensor | None, per_token: bool = True
) -> torch.Tensor:
    """x @ W.T with fbgemm's dynamic int8 GEMM; with per_token each row gets its own activation
    scale."""
    x2 = x.reshape(-1, x.shape[-1]).float()
    if per_token:
        # Each row's largest magnitude as max(max, -min): two vectorised reductions, no |x| copy.
        # The scaled rows go to a reused buffer, the output is rescaled (and biased) in place.
        scale = torch.maximum(x2.amax(1, keepdim=True), x2.amin(1, keepdim=True).neg_())
        scaled = torch.div(x2, scale.clamp_min_(1e-12), out=_rows_buffer(x2.shape))
        y = torch.ops.quantized.linear_dynamic(scaled, packed, True).mul_(scale)
    else:
        y = torch.ops.quantized.linear_dynamic(x2, packed, True)
    if bias is not None:
        y.add_(bias)
    return y.to(x.dtype).reshape(*x.shape[:-1], out_features)


class Linear(nn.Linear):
    """nn.Linear whose kernel the runner's `prepare_weights` chooses: packed (oneDNN float32),
    upcast (bfloat16 weight, float32 compute), int8 (fbgemm), or plain (PyTorch's; on the CPU in
    float32, 2-16 rows as weight @ x.T, where MKL takes a GEMV-like kernel)."""

    kernel = "plain"
    packed_weight = None  # oneDNN's blocked float32 weight, or fbgemm's packed int8 one
    per_token = True

    def pack(self) -> None:
        """Reorder the weight into oneDNN's blocked layout (the hint of 16 rows measured as good
        as any from 2 rows to 1000s) and drop this module's plain weight: it is freed unless
        shared (a tied lm_head's is the embedding's)."""
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), 16)
        self.weight, self.kernel = None, "packed"

    def quantize(self, prepared: dict[str, torch.Tensor] | None = None) -> None:
        """int8 weights, quantized from this layer's weight alone (no float32 copy of the model
        is made), or packed from `prepared` values, scale (and bias) written by an earlier run."""
        if prepared is None:
            self.packed_weight = quantize_int8(self.weight)
        else:
            self.packed_weight = pack_int8(prepared["values"], prepared["scale"])
            if "bias" in prepared:
                self.bias = nn.Parameter(prepared["bias"], requires_grad=False)
        self.weight, self.kernel = None, "int8"

    def int8_prepared(self) -> dict[str, torch.Tensor]:
        """What `quantize(prepared)` takes back: the int8 values, their scales and the bias."""
        q, _ = torch.ops.quantized.linear_unpack(self.packed_weight)
        out = {"values": q.int_repr(), "scale": q.q_per_channel_scales()}
        return out if self.bias is None else {**out, "bias": self.bias.detach()}

    def quantize_int4(self) -> None:
        """4-bit weights with a scale and zero per group of input channels (model/int4.py)."""
        self.packed_weight = quantize_int4(self.weight)
        self.weight, self.kernel = None, "int4"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel == "int4":
            return int4_linear(x, self.packed_weight, self.bias)
        if self.kernel == "packed":
            return torch.ops.mkldnn._linear_pointwise(
                x, self.packed_weight, self.bias, "none", [], ""
            )
        if self.kernel == "int8":
            return int8_linear(x, self.packed_weight, self.out_features, self.bias, self.per_token)
        if self.weight.dtype != x.dtype:
            return upcast_linear(x, self.weight, self.bias)
        if (
            x.device.type != "cpu"
            or x.dim() != 2
            or not 1 < x.shape[0] <= 16
            or x.dtype != torch.float32
        ):
            return super().forward(x)
        y = (self.weight @ x.t()).t()
        return y if self.bias is None else y + self.bias


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


def held_bytes(model: nn.Module) -> int:
    """Bytes the model's weights take as held: every tensor's storage once (a tied weight is
    shared), plus the packed oneDNN and fbgemm weights (int8 values, and a float64 scale and
    int64 zero point per output channel)."""
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
            total += layer.in_features * layer.out_features + 16 * layer.out_features
        elif isinstance(layer, Linear) and layer.kernel == "int4":
            total += layer.packed_weight.nbytes
    total += sum(getattr(m, "int4_bytes", 0) for m in model.modules())  # MoE experts
    return total
