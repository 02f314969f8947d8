"""The kernel plan: which kernel each kind of work of a run uses, and why, chosen once at load from
the device, the precision, the backend, the model's shape and what this machine builds. The load
line prints it, the records carry it beside the precision, and `install` puts its kernels into the
model's layers: each layer names its kind of work (`work`) and calls what is installed as its
`kernel`, keeping its own torch code where nothing is or the inputs are not the kernel's.

Kinds of work: `linears` (the form the weights take: as loaded, oneDNN's packed float32, int8,
int4), `upcast` (bfloat16 weights in float32 arithmetic), `int8`, `attention` (the decoder's
prefill and attention within one image), `vision_blocks` (the packed vision blocks' bounded
attention), `norm`, `rotary`, `swiglu`, `decode_step` (a decode step through every layer in one
call), `experts` (MoE) and `delta_rule` (Gated DeltaNet)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field, fields

from mmcli.kernels import attention, cpu, cpu_ops, delta_rule, experts, fused_decode

# a layer -> the kernel to install in it (None: its own torch code)
Install = Callable[[object], object]


@dataclass(frozen=True)
class Choice:
    kernel: str  # what runs, in words
    why: str
    install: Install | None = field(default=None, compare=False, repr=False)


NONE = Choice("-", "no such work in this model")
TORCH = "torch"
# the forms of `linears` that mmcli/weights puts the weights into at load
PACKED, INT8 = "packed float32 (oneDNN)", "int8"


@dataclass(frozen=True)
class RunShape:
    """What the plan is chosen from (known before the weights are read)."""

    device: str  # cpu, cuda, neuron
    backend: str  # eager, inductor, neuron
    compute: str  # activations' dtype
    loaded: str  # the matrices' dtype as loaded
    quantize: str  # none, int8, int4
    hybrid: bool = False  # Gated DeltaNet layers
    sparse: bool = False  # MoE layers
    fusable_decode: bool = False  # dense attention layers decode_layer.c computes


@dataclass(frozen=True)
class KernelPlan:
    build: str  # our C kernels' build on this machine, or why none loads
    linears: Choice
    upcast: Choice
    int8: Choice
    attention: Choice
    vision_blocks: Choice
    norm: Choice
    rotary: Choice
    swiglu: Choice
    decode_step: Choice
    experts: Choice
    delta_rule: Choice

    def choices(self) -> dict[str, Choice]:
        """Every kind of work this model has, with its choice."""
        every = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "build"}
        return {work: choice for work, choice in every.items() if choice is not NONE}

    def summary(self) -> str:
        """One line for the load line: each kind of work and its kernel, and the C build."""
        works = "; ".join(f"{work} {choice.kernel}" for work, choice in self.choices().items())
        return f"{works}; C kernels: {self.build}"

    def record(self) -> dict[str, str]:
        """What the records carry beside the precision: the kernel of each kind of work, and the
        C kernels' build."""
        kernels = {work: choice.kernel for work, choice in self.choices().items()}
        return {**kernels, "build": self.build}


def _function(kernel: Callable) -> Install:
    return lambda layer: kernel


def _c_kernel(work: str, shape: RunShape, install: Install) -> Choice:
    """One of our C kernels where it runs (the CPU, eager, float32 compute, the library built),
    else torch's operations, saying why."""
    library, reason = cpu.load() if shape.device == "cpu" else (None, "not on the CPU")
    if shape.device != "cpu" or shape.backend != "eager":
        return Choice(TORCH, f"{shape.backend} on {shape.device}: torch's operations")
    if shape.compute != "float32":
        return Choice(TORCH, f"{shape.compute} compute: the C kernels compute in float32")
    if library is None:
        return Choice(TORCH, reason)
    return Choice(work, f"ours ({cpu.name()} build)", install)


def _linears(shape: RunShape) -> Choice:
    if shape.quantize == "int4":
        return Choice("int4 (torch's int4 CPU kernel)", "quantize int4: quantized as read")
    if shape.quantize == "int8":
        return Choice(INT8, "quantize int8: norms folded, a scale per output channel")
    if shape.backend != "eager":
        return Choice("as loaded", "traced into the compiled graphs")
    if shape.device == "cpu" and shape.loaded == shape.compute == "float32":
        return Choice(PACKED, "float32 weights: oneDNN's blocked layout")
    if shape.loaded != shape.compute:
        return Choice("as loaded", f"{shape.loaded} weights, {shape.compute} compute")
    return Choice("as loaded", f"{shape.compute} weights and compute: torch's")


def _upcast(shape: RunShape) -> Choice:
    # quantized runs keep some matrices as loaded too: a tied lm_head, int4's vision tower
    if shape.loaded == shape.compute:
        return NONE
    choice = _c_kernel("bf16_linear.c", shape, _function(cpu_ops.bf16_matmul))
    if choice.install is None:
        return Choice("chunks", f"{choice.why}: each chunk widened in a reused buffer")
    return Choice(
        choice.kernel, "bfloat16 widened in registers; a GEMM above 16 rows", choice.install
    )


def _int8(shape: RunShape) -> Choice:
    if shape.quantize != "int8":
        return NONE
    library, reason = cpu.load()
    if library is None:
        return Choice("int8 in float32", reason)
    why = f"weights stored in its layout ({cpu.name()} build)"
    return Choice("int8_linear.c", why, _function(cpu_ops.int8_matmul))


def _vision_blocks(shape: RunShape, attend: Choice) -> Choice:
    if shape.backend == "neuron":
        from mmcli.kernels.nki import nki_bounded_attention

        return Choice("NKI attention_cte", "Trainium", _function(nki_bounded_attention))
    if shape.backend == "eager" and shape.device == "cpu":
        kernel = attention.segment_attention
        if attend.install is not None:
            kernel = functools.partial(kernel, attend=_with_fallback(cpu_ops.attention))
        return Choice(
            f"by range ({attend.kernel})", "eager: only inside the bounds", _function(kernel)
        )
    return Choice(
        "bounded (masked SDPA)",
        "fixed shapes: one masked call a layer",
        _function(attention.bounded_attention),
    )


def _with_fallback(kernel: Callable) -> Callable:
    def attend(q, k, v, causal=False):
        out = kernel(q, k, v, causal)
        return out if out is not None else attention.sdpa_attention(q, k, v, causal)

    return attend


def _decode_step(shape: RunShape) -> Choice:
    if not shape.fusable_decode or shape.quantize != "none" or shape.loaded != "bfloat16":
        return Choice("layer by layer", "decode_layer.c takes dense bfloat16 layers only")
    choice = _c_kernel("decode_layer.c", shape, fused_decode.FusedDecode.for_decoder)
    return choice if choice.install is not None else Choice("layer by layer", choice.why)


def _experts(shape: RunShape) -> Choice:
    if not shape.sparse:
        return NONE
    if shape.device == "cuda" and shape.compute == "bfloat16" and experts.has_grouped_gemm():
        return Choice(
            "grouped GEMM",
            "torch's, offsets on the device",
            _function(experts.grouped_gemm_where_it_fits),
        )
    return Choice("grouped loop", "each chosen expert once, on its rows")


def _delta_rule(shape: RunShape) -> Choice:
    if not shape.hybrid:
        return NONE
    fla = delta_rule.fla_kernels() if shape.device == "cuda" else None
    if fla is None:
        return Choice("PyTorch", "chunked prefill, one-step decode")
    return Choice("flash-linear-attention", "its Triton kernels", _function(fla))


def choose(shape: RunShape) -> KernelPlan:
    attend = _c_kernel("attention.c", shape, _function(cpu_ops.attention))
    library, reason = cpu.load() if shape.device == "cpu" else (None, "not on the CPU")
    return KernelPlan(
        build=cpu.name() if library is not None else f"none ({reason})",
        linears=_linears(shape),
        upcast=_upcast(shape),
        int8=_int8(shape),
        attention=attend,
        vision_blocks=_vision_blocks(shape, attend),
        norm=_c_kernel("rms_norm.c", shape, _function(cpu_ops.rms_norm)),
        rotary=_c_kernel("pointwise.c", shape, _function(cpu_ops.rotary)),
        swiglu=_c_kernel("pointwise.c", shape, _function(cpu_ops.silu_times)),
        decode_step=_decode_step(shape),
        experts=_experts(shape),
        delta_rule=_delta_rule(shape),
    )


def install(plan: KernelPlan, model) -> None:
    """Each layer of `model` given its kind of work's kernel (None where the plan has none)."""
    choices = plan.choices()
    for layer in model.modules():
        choice = choices.get(getattr(layer, "work", None))
        if choice is not None:
            layer.kernel = choice.install(layer) if choice.install is not None else None
