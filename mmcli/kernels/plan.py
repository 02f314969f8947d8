"""The kernel plan: which kernel each kind of work of a run uses, and why, chosen once at load from
the device, the precision, the backend, the model's shape and what this machine builds. The load
line prints it, the records carry it beside the precision, and `install` puts its kernels into the
model's layers: each layer names its kind of work (`work`) and calls what is installed as its
`kernel`, keeping its own torch code where nothing is or the inputs are not the kernel's.

Kinds of work: `linears` (the form the weights take: as loaded, oneDNN's packed float32, int8,
int4), `upcast` (bfloat16 weights with float32 activations), `head` (the lm_head: as `upcast`,
but in float32 products always), `int8`, `vision_int8` (the vision tower's int8), `int4`,
`attention` (the decoder's prefill and attention within one image), `vision_blocks` (the packed
vision blocks' bounded attention), `norm`, `rotary`, `swiglu`, `decode_step` (a decode step
through every layer in one call), `experts` (MoE) and `delta_rule` (Gated DeltaNet).

On the CPU the choice among ours and the library's (oneDNN through torch) follows the CPU's units
(kernels/cpu_features.py): where they decide it (AMX against our vector kernels), by them; where
two kernels are close (AVX-512 BF16, VNNI's int8 against oneDNN's), by this machine's measurement
(kernels/measure.py, made once and cached)."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass, field, fields

from mmcli.kernels import (
    attention,
    cpu,
    cpu_features,
    cpu_ops,
    delta_rule,
    experts,
    fused_decode,
    matrix,
    measure,
)

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
# the vision tower's int8 kernels (ONEDNN_INT8: its weights are put in rows layout at load)
INT8_OURS, ONEDNN_INT8 = "int8_linear.c", "oneDNN int8 (torch._int_mm)"


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
    products: str = ""  # the matrix products' operands ("": the compute dtype)
    features: cpu_features.CpuFeatures | None = None  # None: this CPU's

    def cpu(self) -> cpu_features.CpuFeatures:
        return self.features or cpu_features.detect()

    def bf16_products(self) -> bool:
        return self.products == "bfloat16" and self.compute == "float32"

    def eager_cpu(self) -> bool:
        return self.device == "cpu" and self.backend == "eager"


@dataclass(frozen=True)
class KernelPlan:
    build: str  # our C kernels' build on this machine, or why none loads
    linears: Choice
    upcast: Choice
    head: Choice
    int8: Choice
    vision_int8: Choice
    int4: Choice
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
        return Choice("int4", "quantize int4: quantized as read, in torch's int4 CPU layout")
    if shape.quantize == "int8":
        return Choice(INT8, "quantize int8: norms folded, a scale per output channel")
    if shape.backend != "eager":
        return Choice("as loaded", "traced into the compiled graphs")
    if shape.device == "cpu" and shape.loaded == shape.compute == "float32":
        return Choice(PACKED, "float32 weights: oneDNN's blocked layout")
    if shape.loaded != shape.compute:
        return Choice("as loaded", f"{shape.loaded} weights, {shape.compute} compute")
    return Choice("as loaded", f"{shape.compute} weights and compute: torch's")


def _measured(name: str, shape: RunShape) -> tuple[int | None, str]:
    """(rows above which the library's kernel wins, why) from this machine's measurement (of
    the library's alone where our C kernels are not built here); MMCLI_CPU_PREFER=library or
    ours stands in for every measurement (tests and benches force each path so)."""
    prefer = os.environ.get("MMCLI_CPU_PREFER")
    if prefer in ("library", "ours"):
        return (0 if prefer == "library" else None), f"MMCLI_CPU_PREFER={prefer}"
    if name != "int4_tiles" and cpu.load()[0] is None:
        return 0, f"ours not built here ({cpu.load()[1]})"
    result = measure.measured(name)
    above = measure.crossover(result["rates"])
    ours, library = result["kernels"]
    rates = ", ".join(f"{a:.0f} vs {b:.0f} at {rows}" for rows, (a, b) in result["rates"].items())
    return above, f"measured here: {ours} vs {library}, G(FL)OP/s by rows: {rates}"


def _tiles(shape: RunShape) -> bool:
    """Whether amx.c's kernels run this shape: eager on a CPU whose units (as the shape sees
    them) include AMX, with our AMX build loaded."""
    units = shape.cpu().units
    return shape.eager_cpu() and {"amx_bf16", "amx_int8"} <= units and cpu.name() == "AMX"


def _upcast(shape: RunShape) -> Choice:
    # quantized runs keep some matrices as loaded too: a tied lm_head, int4's vision tower
    if shape.loaded == shape.compute:
        return NONE
    if shape.bf16_products() and shape.eager_cpu():
        products = _bf16_products(shape)
        if products is not None:
            return products
    choice = _c_kernel("bf16_linear.c", shape, _function(cpu_ops.bf16_matmul))
    if choice.install is None:
        return Choice("chunks", f"{choice.why}: each chunk widened in a reused buffer")
    return Choice(
        choice.kernel, "bfloat16 widened in registers; a GEMM above 16 rows", choice.install
    )


def _head(shape: RunShape, upcast: Choice) -> Choice:
    """The lm_head as the other bfloat16 matrices, but in float32 products: logits rounded to
    bfloat16 would move greedy near-ties and every log-prob (a GEMM at many sequences only)."""
    if not shape.bf16_products() or upcast is NONE:
        return upcast
    ours = _c_kernel("bf16_linear.c", shape, _function(cpu_ops.bf16_matmul))
    if ours.install is None:
        return Choice("chunks", f"{ours.why}: float32 logits")
    if _tiles(shape):
        kernel = f"AMX tiles to {cpu.AMX_ROWS} rows, bf16_linear.c above"
        why = "each activation as two bfloat16 (16 bits) for the logits"
        return Choice(kernel, why, _function(cpu_ops.amx_split_matmul))
    return Choice(ours.kernel, "float32 products for the logits", ours.install)


def _bf16_crossover(shape: RunShape) -> tuple[int | None, str]:
    """The rows above which oneDNN's bfloat16 GEMM beats ours, and why: KERNEL_ROWS on AMX
    (three times ours there), measured on AVX-512 BF16 and Arm's BF16; None where ours wins at
    every measured row count."""
    if "amx_bf16" in shape.cpu().units:
        return cpu_ops.KERNEL_ROWS, "AMX-BF16: the matrix engine above the few-rows kernel"
    return _measured("bf16_gemm", shape)


def _bf16_products(shape: RunShape) -> Choice | None:
    above, why = _bf16_crossover(shape)
    if above is None:
        return None
    if _tiles(shape):
        kernel = f"oneDNN bfloat16 (AMX) above {above} rows, AMX tiles to {above}"
        return Choice(kernel, why, _function(matrix.bf16_products(above, tiles=True)))
    kernel = (
        f"oneDNN bfloat16 ({shape.cpu().engine()}) above {above} rows, bf16_linear.c to {above}"
    )
    return Choice(kernel, why, _function(matrix.bf16_products(above)))


def _int8(shape: RunShape) -> Choice:
    """The decoder's int8: stored in int8_linear.c's layout (decode reads it, bound by memory);
    at many rows on oneDNN's int8 GEMM where that wins (above 64 rows on AMX-INT8, else
    measured), the weights copied to its layout for the call."""
    if shape.quantize != "int8":
        return NONE
    library, reason = cpu.load()
    if _tiles(shape):
        return _int8_tiles()
    if shape.cpu().int8_matrix():
        above, why = 64, "AMX-INT8 above 64 rows: the copy to its layout amortized"
    else:
        above, why = _measured("int8_prefill", shape)
    if above is not None and shape.eager_cpu():
        kernel = f"oneDNN int8 above {above} rows, {INT8_OURS} to {above}"
        return Choice(kernel, why, _function(matrix.int8_products(above)))
    if library is None:
        return Choice("int8 in float32", reason)
    why = f"weights stored in its layout ({cpu.name()} build); decode reads them"
    return Choice(INT8_OURS, why, _function(cpu_ops.int8_matmul))


def _int8_tiles() -> Choice:
    """int8_linear.c's AMX build: the tiles read its layout as stored, at every row count (no
    copy to oneDNN's, which the tiles outrun 2.5x at 256 rows: docs/performance.md)."""
    why = "AMX-INT8 on the weights as stored, at every row count"
    return Choice(f"{INT8_OURS} on AMX tiles", why, _function(cpu_ops.int8_matmul))


def _vision_int8(shape: RunShape) -> Choice:
    """The vision tower's int8 (it never decodes: every product has hundreds of rows) on
    oneDNN's int8 GEMM in rows layout where that wins: AMX-INT8, else measured."""
    if shape.quantize != "int8" or not shape.eager_cpu():
        return NONE
    if _tiles(shape):
        return _int8_tiles()
    if shape.cpu().int8_matrix():
        why = "the matrix engine's int8; rows layout made at load"
    else:
        above, why = _measured("int8_vision", shape)
        if above is None:
            return Choice(INT8_OURS, f"{why}: as the decoder")
    return Choice(ONEDNN_INT8, why, _function(matrix.int8_rows_matmul))


def _int4(shape: RunShape) -> Choice:
    if shape.quantize != "int4":
        return NONE
    if _tiles(shape):
        torch_rows, few = cpu.INT4_TORCH_ROWS, cpu.INT4_FEW_ROWS
        kernel = f"AMX tiles (the integers to {few} rows, dequantized panels above)"
        kernel += f", torch int4 to {torch_rows} rows"
        why = "the weights as stored, on AMX-BF16"
        return Choice(kernel, why, _function(cpu_ops.amx_int4_matmul))
    above, why = _measured("int4_tiles", shape) if shape.eager_cpu() else (None, "")
    if above is None:
        return Choice("torch int4", why or "torch's int4 kernel")
    kernel = f"int4 tiles + oneDNN bfloat16 above {above} rows, torch int4 to {above}"
    return Choice(kernel, why, _function(matrix.int4_matmul(above)))


def _attention(shape: RunShape) -> Choice:
    """attention.c, or torch's flash attention on bfloat16 where it measures faster."""
    ours = _c_kernel("attention.c", shape, _function(cpu_ops.attention))
    if not (shape.bf16_products() and shape.eager_cpu()):
        return ours
    above, why = _measured("attention", shape)
    if above is None and ours.install is not None:
        return Choice(ours.kernel, why, ours.install)
    return Choice("flash attention bfloat16", why, _function(matrix.bf16_attention))


def _vision_blocks(shape: RunShape, attend: Choice) -> Choice:
    if shape.backend == "neuron":
        from mmcli.kernels.nki import nki_bounded_attention

        return Choice("NKI attention_cte", "Trainium", _function(nki_bounded_attention))
    if shape.backend == "eager" and shape.device == "cpu":
        kernel = attention.segment_attention
        if attend.install is not None:
            kernel = functools.partial(kernel, attend=_with_fallback(attend.install(None)))
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
    if shape.bf16_products() and _tiles(shape):
        install = functools.partial(fused_decode.FusedDecode.for_decoder, tiles=True)
        why = f"bfloat16 products, float32 sums, to {cpu.AMX_ROWS} rows"
        return Choice("decode_layer.c on AMX tiles", why, install)
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
    if shape.bf16_products() and shape.eager_cpu():
        above, _ = _bf16_crossover(shape)
        if above is not None:
            kernel = f"grouped loop, oneDNN bfloat16 above {above} rows"
            why = "each chosen expert's bfloat16 weights as held"
            return Choice(kernel, why, _function(matrix.bf16_grouped_experts(above)))
    return Choice("grouped loop", "each chosen expert once, on its rows")


def _delta_rule(shape: RunShape) -> Choice:
    if not shape.hybrid:
        return NONE
    fla = delta_rule.fla_kernels() if shape.device == "cuda" else None
    if fla is None:
        return Choice("PyTorch", "chunked prefill, one-step decode")
    return Choice("flash-linear-attention", "its Triton kernels", _function(fla))


def choose(shape: RunShape) -> KernelPlan:
    attend, upcast = _attention(shape), _upcast(shape)
    library, reason = cpu.load() if shape.device == "cpu" else (None, "not on the CPU")
    return KernelPlan(
        build=cpu.name() if library is not None else f"none ({reason})",
        linears=_linears(shape),
        upcast=upcast,
        head=_head(shape, upcast),
        int8=_int8(shape),
        vision_int8=_vision_int8(shape),
        int4=_int4(shape),
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
