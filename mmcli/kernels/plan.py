"""The kernel plan: which kernel each kind of work of a run uses, and why, chosen once at load from
the device, the precision, the backend, the model's shape and what this machine builds. The load
line prints it, the records carry it beside the precision, and `install` puts its kernels into the
model's layers: each layer names its kind of work (`work`) and calls what is installed as its
`kernel`, keeping its own torch code where nothing is or the inputs are not the kernel's.

Kinds of work: `linears` (the form the weights take: as loaded, oneDNN's packed float32, int8,
int4), `upcast` (bfloat16 weights with float32 activations), `head` (the lm_head: as `upcast`,
but in float32 products always; a quantized run's in int8, on 14 bits of each activation),
`int8`, `vision_int8` (the vision tower's int8), `int4`, `attention` (the decoder's prefill and
attention within one image), `vision_blocks` (the packed vision blocks' bounded attention),
`norm` (RMSNorm) and `layer_norm`, each with the residual stream's add before it, `rotary`,
`swiglu`, `decode_step` (a decode step through every layer in one call), `experts` (MoE) and
`delta_rule` (Gated DeltaNet).

On the CPU the choice among ours and the library's (oneDNN through torch) follows the machine
(kernels/machine.py): its units where they decide it (AMX against our vector kernels), its
measured crossovers where two kernels are close (AVX-512 BF16, VNNI's int8 against oneDNN's).
`choose(RunShape, Machine)` reads nothing else and does nothing else. Each choice has an `id`
that code and tests compare; its `kernel` and `why` are words for people (the load line, the
records, `mmcli doctor`)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field, fields

import torch

from mmcli.kernels import attention, cpu, cpu_ops, delta_rule, experts, fused_decode, matrix
from mmcli.kernels.machine import Crossover, Machine

# a layer -> the kernel to install in it (None: its own torch code)
Install = Callable[[object], object]


@dataclass(frozen=True)
class Choice:
    id: str  # what runs, compared by code and tests
    kernel: str  # what runs, in words
    why: str
    install: Install | None = field(default=None, compare=False, repr=False)
    # where the kernels read the weights in a form of their own, the form mmcli/weights puts
    # them in at load ("": as they are)
    form: str = ""
    # products that round their inputs to bfloat16 at every row count: a norm before them may
    # hand its output on so (hand_on_norms)
    rounds_inputs: bool = False


NONE = Choice("none", "-", "no such work in this model")
# the forms of `linears` that mmcli/weights puts the weights into at load
PACKED, INT8, INT4, AS_LOADED = "packed", "int8", "int4", "as_loaded"
INT4_BLOCKS = "int4_blocks"  # int4's blocks form (weight_forms.Int4Weight.in_blocks)
BY_RANGE = "by_range"  # the vision blocks' attention range by range, each image's own
# the head's choices where it is int8: its activations on 14 bits, or split in two rows of 7
INT8_HEADS = ("int8_wide", "int8_split")
# the vision tower's int8 on oneDNN: its weights are put in rows layout at load
ONEDNN_INT8 = "onednn_int8"
INT8_OURS = "int8_linear.c"  # in words


@dataclass(frozen=True)
class RunShape:
    """What the plan is chosen from, with the machine (known before the weights are read)."""

    device: str  # cpu, cuda, neuron
    backend: str  # eager, inductor, neuron
    compute: str  # activations' dtype
    loaded: str  # the matrices' dtype as loaded
    quantize: str  # none, int8, int4
    hybrid: bool = False  # Gated DeltaNet layers
    sparse: bool = False  # MoE layers
    fusable_decode: bool = False  # dense attention layers decode_layer.c computes
    tied_head: bool = False  # the lm_head is the embedding's table
    products: str = ""  # the matrix products' operands ("": the compute dtype)

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
    cache_attention: Choice
    vision_blocks: Choice
    norm: Choice
    layer_norm: Choice
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


def _c_kernel(work: str, shape: RunShape, machine: Machine, install: Install) -> Choice:
    """One of our C kernels where it runs (the CPU, eager, float32 compute, the library built),
    else torch's operations, saying why."""
    if not shape.eager_cpu():
        return Choice("torch", "torch", f"{shape.backend} on {shape.device}: torch's operations")
    if shape.compute != "float32":
        why = f"{shape.compute} compute: the C kernels compute in float32"
        return Choice("torch", "torch", why)
    if not machine.build:
        return Choice("torch", "torch", machine.unavailable)
    return Choice(work, work, f"ours ({machine.build} build)", install)


def _linears(shape: RunShape) -> Choice:
    if shape.quantize == "int4":
        why = "quantize int4: quantized as read, in torch's int4 CPU layout"
        return Choice(INT4, "int4", why)
    if shape.quantize == "int8":
        return Choice(INT8, "int8", "quantize int8: norms folded, a scale per output channel")
    if shape.backend != "eager":
        return Choice(AS_LOADED, "as loaded", "traced into the compiled graphs")
    if shape.device == "cpu" and shape.loaded == shape.compute == "float32":
        why = "float32 weights: oneDNN's blocked layout"
        return Choice(PACKED, "packed float32 (oneDNN)", why)
    if shape.loaded != shape.compute:
        why = f"{shape.loaded} weights, {shape.compute} compute"
        return Choice(AS_LOADED, "as loaded", why)
    return Choice(AS_LOADED, "as loaded", f"{shape.compute} weights and compute: torch's")


def _tiles(shape: RunShape, machine: Machine) -> bool:
    """Whether amx.c's kernels run this shape: eager on the CPU of a machine with them."""
    return shape.eager_cpu() and machine.tiles()


def _bf16_dot(shape: RunShape, machine: Machine) -> bool:
    """Whether bf16_dot.c runs this shape's few rows: eager on the CPU of a machine with it."""
    return shape.eager_cpu() and machine.bf16_dot()


def _upcast(shape: RunShape, machine: Machine) -> Choice:
    # quantized runs keep some matrices as loaded too: a tied lm_head, int4's vision tower
    if shape.loaded == shape.compute:
        return NONE
    if shape.bf16_products() and shape.eager_cpu():
        products = _bf16_products(shape, machine)
        if products is not None:
            return products
    rows = _float_rows(machine)
    install = _function(functools.partial(cpu_ops.bf16_matmul, few_rows=rows))
    choice = _c_kernel("bf16_linear.c", shape, machine, install)
    if choice.install is None:
        return Choice("chunks", "chunks", f"{choice.why}: each chunk widened in a reused buffer")
    why = f"bfloat16 widened in registers; a GEMM above {rows} rows"
    return Choice(choice.id, choice.kernel, why, choice.install)


def _float_rows(machine: Machine) -> int:
    """The rows bf16_linear.c's float32 products take before its GEMM (bf16_gemm): a decode
    step's cpu.AMX_ROWS on the AVX2 build, whose tiles of 4 rows hold their inputs in registers
    (at 24 and 32 rows 1.2x the GEMM on a 2-core Zen 1, level at 48), else KERNEL_ROWS."""
    return cpu.AMX_ROWS if machine.build == "AVX2" else cpu_ops.KERNEL_ROWS


def _head(shape: RunShape, machine: Machine, upcast: Choice, int8: Choice) -> Choice:
    """The lm_head: a quantized run's int8 (_int8_head) or an untied int4 run's int4 (int4's
    kernel), else as the other bfloat16 matrices, but in float32 products, or 16 bits of each
    activation where a few-rows kernel takes them split: activations rounded to bfloat16 would
    move greedy near-ties and every log-prob (a GEMM at many sequences only)."""
    if shape.quantize == "int4" and not shape.tied_head:
        return Choice("int4", "int4: int4's kernel", "an untied head, quantized with the layers")
    if shape.quantize == "int8" or shape.quantize == "int4" and int8.install is not None:
        return _int8_head(machine, int8)
    if not shape.bf16_products() or upcast is NONE:
        return upcast
    ours = _c_kernel("bf16_linear.c", shape, machine, _function(cpu_ops.bf16_matmul))
    if ours.install is None:
        return Choice("chunks", "chunks", f"{ours.why}: float32 logits")
    why = "each activation as two bfloat16 (16 bits) for the logits"
    install = _function(functools.partial(cpu_ops.head_matmul, split=True))
    if _tiles(shape, machine):
        kernel = f"AMX tiles to {cpu.AMX_ROWS} rows, bf16_linear.c above"
        return Choice("amx_split", f"{kernel}, split", why, install)
    if _bf16_dot(shape, machine):  # the same bits at every row count, as on the tiles
        return Choice("bf16_dot_split", "bf16_dot.c, split", why, install)
    return Choice(ours.id, ours.kernel, "float32 products for the logits", ours.install)


def _int8_head(machine: Machine, int8: Choice) -> Choice:
    """A quantized run's head in int8 (a tied head: a copy beside the embedding's table, where
    an int4 run has the decoder's int8 kernel), an Int8Head: about 14 bits of each activation.
    AVX2's build multiplies int16 levels (int8_linear.c's wide rows: vpmaddwd makes as many
    products as its 7-bit pairs), twice the rate of each activation split in two rows of 7-bit
    levels on int8's kernel, which the VNNI and AMX builds keep (their int8 dot products make
    twice vpmaddwd's products)."""
    if machine.build == "AVX2" and int8.install is not None:
        why = "int8 weights, each activation on 14 bits: vpmaddwd at the rate of 7-bit pairs"
        install = _function(cpu_ops.int8_wide_matmul)
        return Choice(INT8_HEADS[0], f"{INT8_OURS}, 14-bit rows", why, install)
    why = "int8 weights, each activation as two rows of 7-bit levels (about 14 bits)"
    install = None if int8.install is None else _split_rows(int8.install)
    return Choice(f"{INT8_HEADS[1]}+{int8.id}", f"int8 split: {int8.kernel}", why, install)


def _split_rows(rows: Install) -> Install:
    """The head's install on the kernel `rows` installs for 7-bit rows."""
    return lambda layer: functools.partial(cpu_ops.int8_split_matmul, rows=rows(layer))


def int8_head(plan: KernelPlan) -> bool:
    """Whether the plan holds the lm_head in int8 (weights/loader.py quantizes an int4 run's tied
    head by it)."""
    return plan.head.id.startswith(INT8_HEADS)


def _bf16_crossover(machine: Machine) -> tuple[int | None, str]:
    """The rows above which oneDNN's bfloat16 GEMM beats ours, and why: KERNEL_ROWS on AMX
    (three times ours there), measured on AVX-512 BF16 and Arm's BF16; None where ours wins at
    every measured row count. bf16_dot.c, as the tiles, takes KERNEL_ROWS rows at most: a
    prompt's rows then meet oneDNN's GEMM whichever prompts are prefilled beside it (its outputs
    are rounded to bfloat16, ours are not), and a decode step's rows are the fused step's."""
    if "amx_bf16" in machine.cpu.units:
        return cpu_ops.KERNEL_ROWS, "AMX-BF16: the matrix engine above the few-rows kernel"
    measured = machine.crossover("bf16_gemm")
    if machine.bf16_dot():
        above = min(cpu_ops.KERNEL_ROWS, measured.above if measured.above is not None else 1 << 30)
        return above, f"{measured.why}; bf16_dot.c to {cpu_ops.KERNEL_ROWS} rows at most"
    return measured.above, measured.why


def _bf16_products(shape: RunShape, machine: Machine) -> Choice | None:
    above, why = _bf16_crossover(machine)
    if above is None:
        return None
    if _tiles(shape, machine):
        kernel = f"oneDNN bfloat16 (AMX) above {above} rows, AMX tiles to {above}"
        install = _function(matrix.bf16_products(above, few_rows=True))
        return Choice("onednn_bf16+amx_tiles", kernel, why, install, rounds_inputs=True)
    engine = machine.cpu.engine()
    if _bf16_dot(shape, machine):
        kernel = f"oneDNN bfloat16 ({engine}) above {above} rows, bf16_dot.c to {above}"
        install = _function(matrix.bf16_products(above, few_rows=True))
        return Choice("onednn_bf16+bf16_dot.c", kernel, why, install, rounds_inputs=True)
    kernel = f"oneDNN bfloat16 ({engine}) above {above} rows, bf16_linear.c to {above}"
    return Choice("onednn_bf16+bf16_linear.c", kernel, why, _function(matrix.bf16_products(above)))


INEXACT_INT8 = "this CPU has no VNNI: oneDNN's int8 would saturate its 16-bit pairs"


def _int8(shape: RunShape, machine: Machine) -> Choice:
    """The decoder's int8 (an int4 run's: its tied lm_head): stored in int8_linear.c's layout
    (decode reads it, bound by memory); at many rows on oneDNN's int8 GEMM where that wins (above
    64 rows on AMX-INT8, else measured), the weights copied to its layout for the call."""
    if shape.quantize not in ("int8", "int4"):
        return NONE
    if _tiles(shape, machine):
        return _int8_tiles(machine)
    if not machine.exact_int8:
        above, why = None, INEXACT_INT8
    elif machine.cpu.int8_matrix():
        above, why = 64, "AMX-INT8 above 64 rows: the copy to its layout amortized"
    else:
        measured = machine.crossover("int8_prefill")
        above, why = measured.above, measured.why
    if above is not None and shape.eager_cpu():
        kernel = f"oneDNN int8 above {above} rows, {INT8_OURS} to {above}"
        return Choice(
            "onednn_int8+int8_linear.c", kernel, why, _function(matrix.int8_products(above))
        )
    if not machine.build:
        return Choice("int8_float32", "int8 in float32", machine.unavailable)
    why = f"weights stored in its layout ({machine.build} build); decode reads them"
    why = why if machine.exact_int8 else f"{INEXACT_INT8}; {why}"
    return Choice("int8_linear.c", INT8_OURS, why, _function(cpu_ops.int8_matmul))


def _int8_tiles(machine: Machine) -> Choice:
    """int8_linear.c's AMX build: the tiles read its layout as stored (no copy to oneDNN's,
    which the tiles outrun 4x at 256 rows: docs/performance.md), the vector units' dot
    products at a decode step's few rows where they measure faster: the same integers."""
    vnni_rows = _int8_vnni_rows(machine)
    why = "AMX-INT8 on the weights as stored; VNNI, the same integers, where faster: "
    why += machine.crossover("int8_step_rows").why
    tiles = f", VNNI to {vnni_rows} rows, AMX tiles above" if vnni_rows else " on AMX tiles"
    kernel = INT8_OURS + tiles
    install = _function(functools.partial(cpu_ops.int8_matmul, vnni_rows=vnni_rows))
    return Choice("int8_linear.c+amx_tiles", kernel, why, install)


def _int8_vnni_rows(machine: Machine) -> int:
    """The rows int8_linear.c's AMX build keeps on the vector units' dot products: to where the
    tiles measured faster from (every step row where they never did)."""
    above = machine.crossover("int8_step_rows").above
    return cpu.AMX_ROWS if above is None else above


def _vision_int8(shape: RunShape, machine: Machine) -> Choice:
    """The vision tower's int8 (it never decodes: every product has hundreds of rows), int8's
    and int4's (its decoder in 4 bits, the tower at int8's rate), on oneDNN's int8 GEMM in rows
    layout where that wins (AMX-INT8, else measured), else on int8_linear.c. int4 keeps the
    tower as stored where no int8 kernel runs it (int8 in float32 is slower than as stored)."""
    if shape.quantize not in ("int8", "int4") or not shape.eager_cpu():
        return NONE
    if _tiles(shape, machine):
        return _int8_tiles(machine)
    if not machine.exact_int8:
        return _vision_int8_ours(shape, machine, INEXACT_INT8)
    if machine.cpu.int8_matrix():
        why = "the matrix engine's int8; rows layout made at load"
    else:
        measured = machine.crossover("int8_vision")
        why = measured.why
        if measured.above is None:
            return _vision_int8_ours(shape, machine, why)
    kernel = "oneDNN int8 (torch._int_mm)"
    return Choice(ONEDNN_INT8, kernel, why, _function(matrix.int8_rows_matmul))


def _vision_int8_ours(shape: RunShape, machine: Machine, why: str) -> Choice:
    if machine.build:
        install = _function(cpu_ops.int8_matmul)
        return Choice("int8_linear.c", INT8_OURS, f"{why}: as the decoder", install)
    if shape.quantize == "int4":  # MMCLI_CPU_PREFER=ours without our build
        return Choice(AS_LOADED, "as loaded", f"{machine.unavailable}: the tower as stored")
    return Choice("int8_float32", "int8 in float32", machine.unavailable)


def _int4(shape: RunShape, machine: Machine) -> Choice:
    if shape.quantize != "int4":
        return NONE
    if machine.int4_block is None:
        return Choice("torch_int4", "torch int4", "torch's int4 layout here is none ours reads")
    if _tiles(shape, machine) and machine.int4_block == 64:
        return _amx_int4(machine)
    if not shape.eager_cpu():
        return Choice("torch_int4", "torch int4", "torch's int4 kernel")
    measured = machine.crossover("int4_tiles")
    products = "bfloat16" if shape.bf16_products() else "float32"
    if machine.int4_vnni:
        fewest = machine.crossover("int4_fewest_rows")
        widened, blocks = machine.int4_widened, machine.int4_blocks
        return _int4_vnni(measured, fewest, products, widened, blocks)
    if measured.above is None:
        return Choice("torch_int4", "torch int4", measured.why)
    above = measured.above
    kernel = f"int4 tiles + oneDNN {products} above {above} rows, torch int4 to {above}"
    install = _function(matrix.int4_matmul(above, products=products))
    return Choice("int4_tiles+torch_int4", kernel, measured.why, install)


def _amx_int4(machine: Machine) -> Choice:
    """int4 on the AMX build, the weights as stored: with int4_vnni.c, a step's rows on its int8
    products (the vector units' to the measured crossover, the tiles' above), a prompt's widened
    to int8 for the tiles; without it, amx.c's tiles on the weights' integers, then on panels
    dequantized to bfloat16."""
    kernel = f"torch int4 to {cpu.INT4_TORCH_ROWS} rows, "
    if not machine.int4_vnni:
        kernel += f"AMX tiles (the integers to {cpu.INT4_FEW_ROWS} rows, dequantized panels above)"
        why = "the weights as stored, on AMX-BF16"
        return Choice("amx_int4", kernel, why, _function(cpu_ops.amx_int4_matmul))
    vnni_rows = _int4_vnni_rows(machine)
    kernel += f"int8 dot products to {vnni_rows}, " if vnni_rows > cpu.INT4_TORCH_ROWS else ""
    if vnni_rows < cpu.AMX_ROWS:
        kernel += f"AMX-INT8 tiles to {cpu.AMX_ROWS} rows (widened to int8 above)"
    else:
        kernel += "widened to int8 on AMX-INT8 tiles above"
    why = "the weights as stored, on AMX-INT8: " + machine.crossover("int4_step_rows").why
    install = functools.partial(cpu_ops.amx_int4_matmul, vnni_rows=vnni_rows)
    return Choice("amx_int4+int4_widened", kernel, why, _function(install))


def _int4_vnni_rows(machine: Machine) -> int:
    """The rows int4_vnni.c's AMX build keeps on the vector units' dot products: to where its
    tiles measured faster from (every step row where they never did, or off those tiles)."""
    if "int4_step_rows" not in machine.crossovers:
        return cpu.AMX_ROWS
    above = machine.crossover("int4_step_rows").above
    return cpu.AMX_ROWS if above is None else min(above, cpu.AMX_ROWS)


def _int4_vnni(
    tiles: Crossover, fewest: Crossover, products: str, widened: bool = True, blocks: bool = False
) -> Choice:
    """int4 on the int8 dot products: a decode step's rows (to cpu.AMX_ROWS) on int4_vnni.c, each
    row quantized to int8 per group; a prompt's more rows widened to int8 for int8_linear.c's
    tiles (at the int8 rate, each row with a scale of its own: 8 bits with VBMI, 7 on AVX2;
    torch's int4 kernel where the build's tiles are wider than torch's blocks); oneDNN's GEMM in
    the run's `products` on dequantized tiles above the measured crossover, where there is one;
    torch's int4 kernel at a step's fewest rows where it measures faster there. Where int4_vnni.c
    reads the blocks form (`blocks`: its AVX2 half) and its kernels are the weights' only readers,
    they are put so at load (torch's kernel and the tiles' dequantizer read torch's layout)."""
    torch_rows = int4_torch_rows(fewest)
    kernel = f"torch int4 to {torch_rows} rows, " if torch_rows else ""
    vnni = cpu.AMX_ROWS if tiles.above is None else min(tiles.above, cpu.AMX_ROWS)
    kernel += f"int4_vnni.c (int8 dot products) to {vnni}"
    kernels = ["int4_vnni.c"]
    if tiles.above is None or tiles.above > vnni:  # AVX2's build: torch's int4 kernel there
        kernel += ", widened to int8 above" if widened else ", torch int4 above"
        kernel += f" to {tiles.above}" if tiles.above else ""
        kernels += ["int4_widened"] if widened else []
    if tiles.above is not None:
        kernel += f", int4 tiles + oneDNN {products} above"
        kernels.append("int4_tiles")
    install = _function(matrix.int4_matmul(tiles.above, torch_rows, products))
    ours_only = not torch_rows and kernels == ["int4_vnni.c", "int4_widened"]
    kernel += ", blocks form" if blocks and ours_only else ""
    form = INT4_BLOCKS if blocks and ours_only else ""
    return Choice("+".join(kernels), kernel, f"{tiles.why}; {fewest.why}", install, form)


def int4_torch_rows(fewest: Crossover) -> int:
    """The rows torch's int4 kernel keeps from int4_vnni.c: none where ours wins at every one of
    a step's fewest rows, else cpu.INT4_TORCH_ROWS."""
    return 0 if fewest.above is None else cpu.INT4_TORCH_ROWS


def _attention(shape: RunShape, machine: Machine) -> Choice:
    """attention.c (its products on bfloat16 pairs where the run's are bfloat16 and the build has
    them: on the tiles in the AMX build), or torch's flash attention on bfloat16 where it measures
    faster."""
    ours = _c_kernel("attention.c", shape, machine, _function(cpu_ops.attention))
    if not (shape.bf16_products() and shape.eager_cpu()):
        return ours
    if machine.bf16_pairs() and ours.install is not None:
        tiles = machine.tiles()
        pairs, on = ("tiles", "the AMX tiles") if tiles else ("pairs", "bfloat16 pairs")
        install = _function(functools.partial(cpu_ops.attention_pairs, tiles=tiles))
        ours = Choice(f"attention.c+{pairs}", f"attention.c on {on}", ours.why, install)
    measured = machine.crossover("attention")
    if measured.above is None and ours.install is not None:
        return Choice(ours.id, ours.kernel, measured.why, ours.install)
    kernel = "flash attention bfloat16"
    return Choice("flash_bf16", kernel, measured.why, _function(attention.bf16_attention))


def vision_by_range(plan: KernelPlan) -> bool:
    """Whether the plan's attention over vision blocks works range by range (eager on the CPU):
    one row of many images then costs no more than a row each (engine/vision_encoder.py lays a
    wave's blocks end to end)."""
    return plan.vision_blocks.id.startswith(BY_RANGE)


def _vision_blocks(shape: RunShape, attend: Choice) -> Choice:
    if shape.backend == "neuron":
        from mmcli.kernels.nki import nki_bounded_attention

        install = _function(nki_bounded_attention)
        return Choice("nki_attention_cte", "NKI attention_cte", "Trainium", install)
    if shape.eager_cpu():
        kernel = attention.segment_attention
        if attend.install is not None:
            kernel = functools.partial(kernel, attend=_with_fallback(attend.install(None)))
        words, why = f"by range ({attend.kernel})", "eager: only inside the bounds"
        return Choice(f"{BY_RANGE}+{attend.id}", words, why, _function(kernel))
    words, why = "bounded (masked SDPA)", "fixed shapes: one masked call a layer"
    return Choice("bounded_sdpa", words, why, _function(attention.bounded_attention))


def _with_fallback(kernel: Callable) -> Callable:
    def attend(q, k, v, causal=False):
        out = kernel(q, k, v, causal)
        return out if out is not None else attention.sdpa_attention(q, k, v, causal)

    return attend


def _decode_step(shape: RunShape, machine: Machine) -> Choice:
    int8 = shape.quantize == "int8"
    # int4 on int4_vnni.c, AMX's too: one call a layer on the int8 dot products streams the
    # weights faster than amx.c's int4 products layer by layer at every step's rows
    int4 = shape.quantize == "int4" and machine.int4_vnni
    bf16 = shape.quantize == "none" and shape.loaded == "bfloat16"
    if not shape.fusable_decode or not (bf16 or int8 or int4):
        why = "decode_layer.c takes dense bfloat16, int8 or (with int4_vnni.c) int4 layers only"
        return Choice("layer_by_layer", "layer by layer", why)
    if int4:
        torch_rows = int4_torch_rows(machine.crossover("int4_fewest_rows"))
        vnni_rows = _int4_vnni_rows(machine) if _tiles(shape, machine) else cpu.AMX_ROWS
        step = functools.partial(
            fused_decode.FusedDecode.for_decoder,
            int4_torch_rows=torch_rows,
            int4_vnni_rows=vnni_rows,
        )
        choice = _c_kernel("decode_layer.c+int4_vnni.c", shape, machine, step)
        why = f"int4_vnni.c's products at {torch_rows + 1} to {cpu.AMX_ROWS} rows"
        why += ", fewer layer by layer (torch's int4 kernel)" if torch_rows else ""
        if choice.install is None:
            return Choice("layer_by_layer", "layer by layer", choice.why)
        kernel = "decode_layer.c, int4 on int4_vnni.c"
        kernel += f", AMX tiles above {vnni_rows} rows" if vnni_rows < cpu.AMX_ROWS else ""
        return Choice(choice.id, kernel, why, choice.install)
    if bf16 and shape.bf16_products() and (_tiles(shape, machine) or _bf16_dot(shape, machine)):
        install = functools.partial(fused_decode.FusedDecode.for_decoder, bf16_products=True)
        why = f"bfloat16 products, float32 sums, to {cpu.AMX_ROWS} rows"
        if _tiles(shape, machine):
            return Choice("decode_layer.c+amx_tiles", "decode_layer.c on AMX tiles", why, install)
        kernel = "decode_layer.c on AVX-512 BF16 dot products (bf16_dot.c)"
        return Choice("decode_layer.c+bf16_dot.c", kernel, why, install)
    work = "decode_layer.c+int8_linear.c" if int8 else "decode_layer.c"
    step = fused_decode.FusedDecode.for_decoder
    if int8 and _tiles(shape, machine):
        step = functools.partial(step, int8_vnni_rows=_int8_vnni_rows(machine))
    if not int8:
        step = functools.partial(step, float_rows=_float_rows(machine))
    choice = _c_kernel(work, shape, machine, step)
    if choice.install is None:
        return Choice("layer_by_layer", "layer by layer", choice.why)
    if int8:
        why = f"int8_linear.c's products to {cpu.AMX_ROWS} rows, each row's levels made once"
        return Choice(work, "decode_layer.c, int8 on int8_linear.c", why, choice.install)
    return choice


def _experts(shape: RunShape, machine: Machine) -> Choice:
    if not shape.sparse:
        return NONE
    if shape.device == "cuda" and shape.compute == "bfloat16" and experts.has_grouped_gemm():
        install = _function(experts.grouped_gemm_where_it_fits)
        return Choice("grouped_gemm", "grouped GEMM", "torch's, offsets on the device", install)
    if shape.bf16_products() and shape.eager_cpu():
        above, _ = _bf16_crossover(machine)
        if above is not None:
            kernel = f"grouped loop, oneDNN bfloat16 above {above} rows"
            why = "each chosen expert's bfloat16 weights as held"
            install = _function(experts.bf16_grouped_experts(above))
            return Choice("grouped_loop+onednn_bf16", kernel, why, install)
    return Choice("grouped_loop", "grouped loop", "each chosen expert once, on its rows")


def _delta_rule(shape: RunShape, machine: Machine) -> Choice:
    """Gated DeltaNet's rule: flash-linear-attention's kernels on CUDA where installed; else
    PyTorch's chunked prefill, its decode steps on delta_rule.c where our kernels run (each
    row's state advanced in place in the cache, where PyTorch's step gathers and scatters it)."""
    if not shape.hybrid:
        return NONE
    if shape.device == "cuda" and "fla" in machine.libraries:
        install = _function(delta_rule.fla_kernels())
        return Choice("fla", "flash-linear-attention", "its Triton kernels", install)
    pair = _function((delta_rule.chunked, cpu_ops.delta_step))
    steps = _c_kernel("delta_rule.c", shape, machine, pair)
    if steps.install is None:
        return Choice("pytorch", "PyTorch", f"chunked prefill, one-step decode; {steps.why}")
    kernel = "PyTorch's chunked prefill, delta_rule.c's steps"
    return Choice("pytorch+delta_rule.c", kernel, steps.why, steps.install)


def choose(shape: RunShape, machine: Machine) -> KernelPlan:
    """The kernel of each kind of work for a run of `shape` on `machine`."""
    attend, upcast = _attention(shape, machine), _upcast(shape, machine)
    int8 = _int8(shape, machine)  # the head's too where it is int8
    build = machine.describe_build() if shape.device == "cpu" else "none (not on the CPU)"
    return KernelPlan(
        build=build,
        linears=_linears(shape),
        upcast=upcast,
        head=_head(shape, machine, upcast, int8),
        int8=int8,
        vision_int8=_vision_int8(shape, machine),
        int4=_int4(shape, machine),
        attention=attend,
        cache_attention=_c_kernel(
            "decode_layer.c", shape, machine, _function(cpu_ops.cache_attention)
        ),
        vision_blocks=_vision_blocks(shape, attend),
        norm=_c_kernel("rms_norm.c", shape, machine, _function(cpu_ops.rms_norm)),
        layer_norm=_c_kernel("layer_norm.c", shape, machine, _function(cpu_ops.layer_norm)),
        rotary=_c_kernel("pointwise.c", shape, machine, _function(cpu_ops.rotary)),
        swiglu=_c_kernel("pointwise.c", shape, machine, _function(cpu_ops.silu_times)),
        decode_step=_decode_step(shape, machine),
        experts=_experts(shape, machine),
        delta_rule=_delta_rule(shape, machine),
    )


def install(plan: KernelPlan, model) -> None:
    """Each layer of `model` given its kind of work's kernel (None where the plan has none)."""
    choices = plan.choices()
    for layer in model.modules():
        choice = choices.get(getattr(layer, "work", None))
        if choice is not None:
            layer.kernel = choice.install(layer) if choice.install is not None else None


def hand_on_norms(plan: KernelPlan, groups) -> None:
    """Each norm of the family's fold groups (scope, [(norm, its readers)]) whose readers are all
    linears on the `upcast` products, where those round their inputs to bfloat16 (the GEMM, and
    the tiles or AVX-512 BF16 at a few rows): its kernel (installed first) hands its output on in
    bfloat16 (`rounded`), the values each reader would round to, one rounding in place of one a
    reader. (A few rows with a bias, on bf16_linear.c, then widen that input exactly.)"""
    if not plan.upcast.rounds_inputs:
        return
    for _, scope_groups in groups:
        for norm, readers in scope_groups:
            upcast = all(
                getattr(r, "work", None) == "upcast" and r.weight.dtype == torch.bfloat16
                for r in readers
            )
            if upcast and hasattr(norm, "rounded") and norm.kernel is not None:
                norm.rounded = True
