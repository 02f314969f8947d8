"""The CPU's matrix engines: the units read from /proc/cpuinfo or forced, the precision `auto`
resolves to from them, the plan's choice among ours and the library's kernels (machines built
by hand), the library kernels' numbers against float32 on any CPU (oneDNN runs
bfloat16 and int8 everywhere), and, where the CPU has AMX, that oneDNN runs on it."""

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_same_choices, forced_logits, greedy, photo

from mmcli.kernels import attention, cpu, cpu_features, cpu_ops, matrix, measure, weight_forms
from mmcli.kernels import experts as experts_module
from mmcli.kernels.machine import Crossover, Machine, comparisons
from mmcli.kernels.plan import INT4_BLOCKS, INT8_OURS, ONEDNN_INT8, RunShape, choose
from mmcli.kernels.weight_forms import Int4Weight
from mmcli.models.layers.quantized import int4_linear, int8_reference
from mmcli.weights.int4 import int4_values, quantize_int4
from mmcli.weights.int8 import as_rows, quantize_int8
from mmcli.weights.precision import Precision, run_precision

needs_kernels = pytest.mark.skipif(
    cpu.why_unavailable() is not None, reason="no AVX2 or no C compiler here"
)
ZEN4 = "fpu sse avx2 fma avx512f avx512bw avx512_bf16 avx512_vnni"
GRAVITON = "processor\t: 0\nFeatures\t: fp asimd asimddp bf16 i8mm sve\nCPU part\t: 0xd4f\n"


def features(*units: str) -> cpu_features.CpuFeatures:
    return cpu_features.CpuFeatures("x86_64", "test CPU", 2, frozenset(units), overridden=True)


AVX2 = features("avx2", "fma")
AVX512_BF16 = features("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16")
AMX = features("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")
SHAPE = RunShape("cpu", "eager", "float32", "bfloat16", "none", fusable_decode=True)


def shape_on(cpu_units: cpu_features.CpuFeatures, **fields) -> RunShape:
    products = "bfloat16" if cpu_units.bf16_matrix() else "float32"
    return dataclasses.replace(SHAPE, products=products, **fields)


def machine(
    units: cpu_features.CpuFeatures,
    build: str = "AVX2",
    above: int | None = None,
    int4_vnni: bool = False,
):
    """A machine with `units` and our `build` (`int4_vnni`: with int4_vnni.c and VBMI's
    widening), every comparison
    it consults measured with the library's kernel winning above `above` rows (None: ours
    everywhere)."""
    consulted = comparisons(units, build, int4_vnni)
    measured = {name: Crossover(above, "measured (by hand)") for name in consulted}
    return Machine(units, build, crossovers=measured, int4_vnni=int4_vnni, int4_widened=int4_vnni)


def test_the_units_are_read_from_cpuinfo_for_x86_and_aarch64():
    zen4 = cpu_features.reported_units({"flags": ZEN4})
    assert zen4 == {"avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni"}
    arm = dict(line.split("\t: ", 1) for line in GRAVITON.strip().splitlines())
    assert cpu_features.reported_units(arm) == {"asimddp", "bf16", "i8mm", "sve"}
    assert features("bf16").engine() == "BFMMLA" and features("i8mm").int8_matrix()
    assert AMX.engine() == "AMX" and not AVX2.bf16_matrix() and AVX512_BF16.bf16_matrix()


def test_the_override_replaces_the_cpus_units_and_names_an_unknown_one(monkeypatch):
    monkeypatch.setenv("MMCLI_CPU_FEATURES", "amx_bf16, avx2")
    forced = cpu_features.detect()
    assert forced.units == {"amx_bf16", "avx2"} and forced.overridden
    assert "from MMCLI_CPU_FEATURES" in forced.describe()
    assert not cpu.has_vnni()  # our C kernels never take a unit from the override
    assert cpu_features.parse_override("none") == frozenset()
    with pytest.raises(ValueError, match="unknown unit.*amx_fp16"):
        cpu_features.parse_override("amx_fp16")


@pytest.mark.parametrize(
    ("dtype", "checkpoint", "device", "bf16_matrix", "compute", "products"),
    [
        ("auto", "bfloat16", "cpu", True, "float32", "bfloat16"),
        ("auto", "bfloat16", "cpu", False, "float32", "float32"),
        ("auto", "float32", "cpu", True, "float32", "float32"),  # a float32 checkpoint stays
        ("float32", "bfloat16", "cpu", True, "float32", "float32"),  # exact, as transformers'
        ("bfloat16", "bfloat16", "cpu", False, "bfloat16", "bfloat16"),
        ("auto", "bfloat16", "cuda", True, "bfloat16", "bfloat16"),
    ],
)
def test_auto_multiplies_in_bfloat16_only_where_the_cpu_does_it_in_hardware(
    dtype, checkpoint, device, bf16_matrix, compute, products
):
    precision = run_precision(dtype, "auto", "none", checkpoint, device, bf16_matrix)
    assert (precision.compute, precision.products) == (compute, products)


@pytest.mark.parametrize(
    ("quantize", "bf16_matrix", "kv_dtype"),
    [
        ("none", False, torch.float32),  # float32 products: the cache as exact as they are
        ("none", True, torch.bfloat16),  # the products' dtype
        ("int8", False, torch.bfloat16),  # levels coarser than bfloat16 already
        ("int4", False, torch.bfloat16),
    ],
)
def test_the_kv_cache_is_bfloat16_where_the_products_or_the_weights_are_coarser(
    quantize, bf16_matrix, kv_dtype
):
    precision = run_precision("auto", "auto", quantize, "bfloat16", "cpu", bf16_matrix)
    assert precision.kv_dtype == kv_dtype


def test_crossover_is_where_the_library_wins_by_the_margin_from_there_on():
    assert measure.crossover({8: (100, 90), 16: (100, 105), 32: (100, 200)}) == 16
    assert measure.crossover({8: (100, 200), 16: (100, 200)}) == 0
    assert measure.crossover({8: (100, 200), 16: (100, 90)}) is None


def test_an_avx2_cpu_keeps_todays_kernels_and_float32_products():
    plan = choose(shape_on(AVX2), machine(AVX2))
    assert plan == choose(SHAPE, machine(AVX2))
    upcast = plan.upcast.install(None)
    # bf16_linear.c's float32 products to a decode step's rows (its GEMM above), fused or not
    assert upcast.func is cpu_ops.bf16_matmul and upcast.keywords == {"few_rows": cpu.AMX_ROWS}
    assert plan.decode_step.install.keywords == {"float_rows": cpu.AMX_ROWS}
    assert plan.attention.id == "attention.c" and plan.build == "AVX2"


def test_amx_takes_onednn_above_the_few_rows_kernel_without_measuring():
    assert comparisons(AMX, "AVX-512 VNNI") == ("attention", "int4_tiles")
    assert comparisons(AMX, "AVX-512 BF16", int4_vnni=True)[-1] == "int4_fewest_rows"
    plan = choose(shape_on(AMX, quantize="int8"), machine(AMX, "AVX-512 VNNI"))
    assert plan.upcast.id == "onednn_bf16+bf16_linear.c"
    assert plan.upcast.kernel.startswith("oneDNN bfloat16 (AMX) above 16 rows, bf16_linear.c")
    assert plan.vision_int8.id == ONEDNN_INT8
    assert plan.int8.kernel == f"oneDNN int8 above 64 rows, {INT8_OURS} to 64"
    assert plan.attention.id == "attention.c"  # measured (by hand): ours wins


@pytest.mark.parametrize("units", [AVX2, AMX], ids=["avx2", "amx_units"])
def test_onednns_int8_is_never_taken_where_it_would_saturate(units):
    """Measured faster or not, where the CPU itself has no VNNI (its units shown as AMX too, as
    tests and benches force them) int8 and the vision tower stay on int8_linear.c."""
    inexact = dataclasses.replace(machine(units, "AVX2", above=0), exact_int8=False)
    consulted = comparisons(units, "AVX2", exact_int8=False)  # so never measured either
    assert not {"int8_prefill", "int8_vision"} & set(consulted)
    plan = choose(shape_on(units, quantize="int8"), inexact)
    assert plan.int8.id == "int8_linear.c" and plan.vision_int8.id == "int8_linear.c"
    assert "saturate" in plan.int8.why and "saturate" in plan.vision_int8.why
    exact = choose(shape_on(units, quantize="int8"), machine(units, "AVX2", above=0))
    assert exact.vision_int8.id == ONEDNN_INT8


def test_int4_takes_our_kernels_only_on_the_layout_they_read():
    """torch packs int4 for the kernel it dispatches to: blocks of 64 channels (AVX-512), which
    amx.c, int4_vnni.c and the C dequantizer read; on blocks of 32 (AVX2 dispatch on any CPU)
    torch's kernel or the tiles' dequantizer in torch's operations; on another, torch's alone."""
    shape = shape_on(AMX, quantize="int4")
    assert choose(shape, machine(AMX, "AMX")).int4.id == "amx_int4"
    amx = machine(AMX, "AMX")
    tiles = {**amx.crossovers, "int4_tiles": Crossover(None, "measured (by hand)")}
    blocks_of_32 = dataclasses.replace(amx, int4_block=32, crossovers=tiles)
    expected = ("attention", "int8_step_rows", "int4_tiles")
    assert comparisons(AMX, "AMX", int4_block=32) == expected
    assert choose(shape, blocks_of_32).int4.id == "torch_int4"
    unknown = dataclasses.replace(machine(AVX512_BF16, "AVX-512 BF16"), int4_block=None)
    assert "int4_tiles" not in comparisons(AVX512_BF16, "AVX-512 BF16", int4_block=None)
    assert choose(shape_on(AVX512_BF16, quantize="int4"), unknown).int4.id == "torch_int4"


def test_our_amx_build_puts_the_few_rows_the_logits_and_int8_on_the_tiles():
    amx = machine(AMX, "AMX")
    assert comparisons(AMX, "AMX") == ("attention", "int8_step_rows")
    plan = choose(shape_on(AMX, quantize="int8"), amx)
    assert plan.upcast.id == "onednn_bf16+amx_tiles"
    assert plan.upcast.kernel == "oneDNN bfloat16 (AMX) above 16 rows, AMX tiles to 16"
    # the logits in int8 on int8's kernel, each activation split
    assert plan.head.id == "int8_split+int8_linear.c+amx_tiles"
    assert plan.head.kernel.startswith("int8 split: ") and plan.head.install is not None
    assert choose(shape_on(AMX), amx).head.id == "amx_split"
    assert plan.int8.id == plan.vision_int8.id == "int8_linear.c+amx_tiles"
    int4 = choose(shape_on(AMX, quantize="int4"), amx).int4
    assert int4.id == "amx_int4" and int4.kernel.endswith("dequantized panels above)")
    assert choose(shape_on(AMX), amx).decode_step.id == "decode_layer.c+amx_tiles"
    # units without AMX (as MMCLI_CPU_FEATURES masks them) keep the vector kernels
    masked = machine(AVX2, "AMX")
    assert not masked.tiles() and "int8_prefill" in masked.crossovers
    assert choose(shape_on(AVX2, quantize="int8"), masked).int8.id == "int8_linear.c"


def test_bfloat16_products_take_attention_on_bfloat16_pairs_where_the_build_has_them():
    """On AVX-512 BF16's dot products, or the AMX tiles where the units and build have them."""
    for units, build, on in [
        (AVX512_BF16, "AVX-512 BF16", "bfloat16 pairs"),
        (AVX512_BF16, "AMX", "bfloat16 pairs"),  # the tiles masked
        (AMX, "AMX", "the AMX tiles"),
    ]:
        plan = choose(shape_on(units), machine(units, build))
        install = plan.attention.install(None)
        assert install.func is cpu_ops.attention_pairs
        assert install.keywords == {"tiles": on == "the AMX tiles"}
        assert plan.vision_blocks.kernel == f"by range (attention.c on {on})"
    float32 = choose(shape_on(AVX2), machine(AVX2, "AVX-512 BF16"))  # float32 products
    assert float32.attention.install(None) is cpu_ops.attention


@pytest.mark.parametrize("ours", [True, False])
def test_avx512_bf16_chooses_by_this_machines_measurement(ours):
    zen4 = machine(AVX512_BF16, "AVX-512 VNNI", above=None if ours else 8)
    plan = choose(shape_on(AVX512_BF16, quantize="int8"), zen4)
    if ours:
        assert plan.upcast.id == "bf16_linear.c" and plan.attention.id == "attention.c"
        assert plan.vision_int8.id == plan.int8.id == "int8_linear.c"
    else:
        assert plan.upcast.id == "onednn_bf16+bf16_linear.c"
        assert plan.upcast.kernel.startswith("oneDNN bfloat16 (AVX-512 BF16) above 8 rows")
        assert plan.attention.install(None) is attention.bf16_attention
        assert plan.vision_int8.id == ONEDNN_INT8
        assert plan.int8.kernel == f"oneDNN int8 above 8 rows, {INT8_OURS} to 8"
        assert plan.upcast.why == "measured (by hand)"


@pytest.mark.parametrize("units", [AVX2, AVX512_BF16, AMX])
@pytest.mark.parametrize("above", [None, 8])
def test_int4_runs_the_vision_tower_on_int8s_kernel(units, above):
    """int4's decoder is in 4 bits and its vision tower (every product hundreds of rows) at
    int8's rate, on the kernel an int8 run's tower takes; as stored where none runs it."""
    for build in ("AVX2", "AVX-512 BF16", "AMX"):
        here = machine(units, build, above)
        int4 = choose(shape_on(units, quantize="int4"), here).vision_int8
        assert int4 == choose(shape_on(units, quantize="int8"), here).vision_int8
        assert int4.install is not None
    ours = {name: Crossover(None, "ours") for name in ("int8_prefill", "int8_vision", "int4_tiles")}
    unbuilt = Machine(AVX2, "", "no compiler", ours)
    as_stored = choose(shape_on(AVX2, quantize="int4"), unbuilt).vision_int8
    assert as_stored.id == "as_loaded" and as_stored.install is None


@pytest.mark.parametrize("units", [AVX2, AMX])
def test_a_quantized_runs_logits_are_int8_but_an_untied_int4_head(units):
    """int8's head, and int4's tied one (a copy beside the embedding's table), in int8: on AVX2's
    build on 14-bit rows, elsewhere on the decoder's int8 kernel, each activation split; an
    untied int4 head is int4 as read; without our build an int4 run's tied head stays as
    loaded."""
    build = "AMX" if units is AMX else "AVX2"
    for quantize, tied in [("int8", False), ("int8", True), ("int4", True), ("int4", False)]:
        shape = dataclasses.replace(shape_on(units, quantize=quantize), tied_head=tied)
        plan = choose(shape, machine(units, build))
        int8 = "int8_wide" if build == "AVX2" else f"int8_split+{plan.int8.id}"
        if (quantize, tied) == ("int4", False):
            assert plan.head.id == "int4" and plan.head.install is None
        else:
            assert plan.head.id == int8 and plan.head.install is not None
    ours = {name: Crossover(None, "ours") for name in ("int8_prefill", "int8_vision", "int4_tiles")}
    unbuilt = Machine(AVX2, "", "no compiler", ours)
    tied_int4 = dataclasses.replace(shape_on(AVX2, quantize="int4"), tied_head=True)
    assert choose(tied_int4, unbuilt).head.id == "chunks"


@pytest.mark.parametrize("above", [None, 8, 32])
def test_avx512_bf16_dot_products_take_the_few_rows_and_the_decode_step(above):
    """On our AVX-512 BF16 build (no tiles) bf16_dot.c's bfloat16 products take the few rows
    (to the measured crossover, KERNEL_ROWS at most: more are a prompt's, oneDNN's whatever
    prompts share its call) and the decode step; the logits take it split (16 bits of each
    activation), as on the tiles; the VNNI build on the same units keeps bf16_linear.c."""
    plan = choose(shape_on(AVX512_BF16), machine(AVX512_BF16, "AVX-512 BF16", above=above))
    rows = 8 if above == 8 else cpu_ops.KERNEL_ROWS
    assert plan.upcast.id == "onednn_bf16+bf16_dot.c"
    assert plan.upcast.kernel.endswith(f"above {rows} rows, bf16_dot.c to {rows}")
    assert plan.decode_step.id == "decode_layer.c+bf16_dot.c"
    assert plan.head.id == "bf16_dot_split"
    vnni = choose(shape_on(AVX512_BF16), machine(AVX512_BF16, "AVX-512 VNNI", above=above))
    assert vnni.decode_step.id == "decode_layer.c" and "bf16_dot" not in vnni.upcast.id
    int8 = choose(shape_on(AVX512_BF16, quantize="int8"), machine(AVX512_BF16, "AVX-512 BF16"))
    assert int8.decode_step.id == "decode_layer.c+int8_linear.c"
    assert int8.head.id == f"int8_split+{int8.int8.id}"  # a quantized run's logits: int8's
    # the default run's logits from 16 bits of each activation
    x, weight = torch.randn(3, 40), torch.randn(24, 40).bfloat16()
    products = plan.head.install(None)(x, weight, None, None)
    assert torch.equal(products, cpu_ops.bf16_rows_matmul(x, weight, split=True))


@pytest.mark.parametrize("above", [None, 0, 4])
def test_amx_int8_keeps_the_dot_products_to_the_rows_where_they_measured_faster(above):
    """int8_linear.c's AMX build hands a product to the tiles above the rows where the vector
    units' dot products (the same integers) read the weights faster, layer by layer and in the
    decode step alike: every step row where the tiles never won (None), none where they always
    did (0)."""
    plan = choose(shape_on(AMX, quantize="int8"), machine(AMX, "AMX", above=above))
    vnni_rows = {None: cpu.AMX_ROWS, 0: 0, 4: 4}[above]
    assert plan.int8.install(None).keywords == {"vnni_rows": vnni_rows}
    assert plan.decode_step.install.keywords == {"int8_vnni_rows": vnni_rows}
    tiles = "on AMX tiles" if above == 0 else f"VNNI to {vnni_rows} rows, AMX tiles above"
    assert plan.int8.kernel.endswith(tiles)


@pytest.mark.parametrize("above", [None, 16, 256])
def test_int4_takes_int4_vnni_at_a_decode_steps_rows_where_it_is_built(above):
    """With int4_vnni.c (AVX-512 VNNI and VBMI, no tiles) int4 takes it from one row where it
    measures faster than torch's int4 kernel there (above torch's two rows where it does not),
    to a decode step's 32 rows, a prompt's more rows widened to int8, each to the measured
    crossover with the tiles on oneDNN where there is one; the decode step takes int4 layers
    from the same row count, on AMX too (its prompts stay on the tiles)."""
    built = machine(AVX512_BF16, "AVX-512 BF16", above=above, int4_vnni=True)
    plan = choose(shape_on(AVX512_BF16, quantize="int4"), built)
    kernels = {
        None: ("int4_vnni.c+int4_widened", "to 32, widened to int8 above"),
        16: ("int4_vnni.c+int4_tiles", "to 16, int4 tiles"),
        256: ("int4_vnni.c+int4_widened+int4_tiles", "to 32, widened to int8 above to 256, int4"),
    }
    assert plan.int4.id == kernels[above][0] and kernels[above][1] in plan.int4.kernel
    assert plan.int4.kernel.startswith("int4_vnni.c" if above is None else "torch int4 to 2 rows")
    assert plan.decode_step.id == "decode_layer.c+int4_vnni.c"
    fewest = "int4_vnni.c's products at 1 to" if above is None else "at 3 to"
    assert fewest in plan.decode_step.why
    unbuilt = choose(shape_on(AVX512_BF16, quantize="int4"), machine(AVX512_BF16, "AVX-512 BF16"))
    assert unbuilt.int4.id == "torch_int4" and unbuilt.decode_step.id == "layer_by_layer"
    amx_machine = machine(AMX, "AMX", above=above, int4_vnni=True)
    assert comparisons(AMX, "AMX", int4_vnni=True)[-2:] == ("int4_fewest_rows", "int4_step_rows")
    amx = choose(shape_on(AMX, quantize="int4"), amx_machine)
    assert amx.int4.id == "amx_int4+int4_widened"  # a prompt's rows on AMX-INT8
    assert amx.decode_step.id == "decode_layer.c+int4_vnni.c"
    assert fewest in amx.decode_step.why
    # a step's rows on the vector units' dot products to where the tiles measured faster
    tiles = {None: "to 32, widened to int8 on AMX-INT8 tiles above"}
    tiles[16] = "to 16, AMX-INT8 tiles to 32 rows (widened to int8 above)"
    assert amx.int4.kernel.endswith(tiles.get(above, tiles[None]))
    vnni_rows = {None: 32, 16: 16, 256: 32}[above]
    assert amx.int4.install(None).keywords == {"vnni_rows": vnni_rows}
    assert amx.decode_step.install.keywords["int4_vnni_rows"] == vnni_rows
    assert ("AMX tiles above 16 rows" in amx.decode_step.kernel) == (above == 16)


def test_the_plan_is_a_function_of_the_shape_and_the_machine(monkeypatch):
    """choose() reads no environment, builds nothing and measures nothing: the same shape and
    machine give the same plan whatever the process around them says."""
    zen4 = machine(AVX512_BF16, "AVX-512 VNNI", above=8)
    before = choose(shape_on(AVX512_BF16, quantize="int8"), zen4)
    for name in ("MMCLI_CPU_FEATURES", "MMCLI_CPU_KERNEL", "MMCLI_CPU_PREFER"):
        monkeypatch.setenv(name, "0" if name == "MMCLI_CPU_KERNEL" else "none")
    monkeypatch.setattr(cpu, "load", None)
    monkeypatch.setattr(measure, "measured", None)
    assert choose(shape_on(AVX512_BF16, quantize="int8"), zen4) == before
    from mmcli.kernels import plan as plan_module

    assert "environ" not in Path(plan_module.__file__).read_text()
    with pytest.raises(KeyError, match="int8_prefill is not measured on this machine"):
        choose(shape_on(AVX2, quantize="int8"), Machine(AVX2, "AVX2"))


@needs_kernels
@pytest.mark.parametrize("above", [None, 256])
def test_int4_on_avx2_takes_int4_vnni_at_a_steps_rows_and_widens_a_prompts(above):
    """AVX2's build reads torch's blocks of 32 channels on vpmaddubsw: a decode step's rows (to
    32) on int4_vnni.c, in the fused step too; a prompt's more rows widened to int8 for
    int8_linear.c's tiles (7-bit rows), above the measured crossover on dequantized tiles in
    float32 products, the run's (no bfloat16 unit). Where its kernels are the only ones to read
    the weights, they are put in the blocks form (which the build reads fastest); torch's int4
    kernel and the tiles' dequantizer read torch's layout."""
    consulted = comparisons(AVX2, "AVX2", int4_vnni=True)
    assert "int4_fewest_rows" in consulted and "int4_tiles" in consulted
    ours = {name: Crossover(None, "measured (by hand)") for name in consulted}
    ours["int4_tiles"] = Crossover(above, "measured (by hand)")
    avx2 = Machine(
        AVX2, "AVX2", crossovers=ours, int4_vnni=True, int4_widened=True, int4_blocks=True
    )
    plan = choose(shape_on(AVX2, quantize="int4"), avx2)
    kernel = "int4_vnni.c (int8 dot products) to 32, widened to int8 above"
    tiles = " to 256, int4 tiles + oneDNN float32 above" if above else ", blocks form"
    assert plan.int4.kernel == kernel + tiles
    assert plan.int4.id == "int4_vnni.c+int4_widened" + ("+int4_tiles" if above else "")
    assert plan.int4.form == ("" if above else INT4_BLOCKS)
    assert plan.decode_step.id == "decode_layer.c+int4_vnni.c"
    torch_first = {**ours, "int4_fewest_rows": Crossover(2, "measured (by hand)")}
    avx2 = dataclasses.replace(avx2, crossovers=torch_first)
    assert choose(shape_on(AVX2, quantize="int4"), avx2).int4.form == ""


@pytest.mark.parametrize("prefer", ["library", "ours"])
def test_mmcli_cpu_prefer_stands_in_for_every_measurement(monkeypatch, prefer):
    from mmcli.kernels import machine as machines

    monkeypatch.setenv("MMCLI_CPU_PREFER", prefer)
    monkeypatch.setenv("MMCLI_CPU_FEATURES", ",".join(sorted(AVX512_BF16.units)))
    monkeypatch.setattr(measure, "measured", None)  # never called
    here = machines.here()
    library = prefer == "library"
    consulted = comparisons(here.cpu, here.build, here.int4_vnni, here.int4_block, here.exact_int8)
    assert set(here.crossovers) == set(consulted)
    plan = choose(shape_on(AVX512_BF16, quantize="int8"), here)
    assert ("above 0 rows" in plan.upcast.kernel) == library
    assert (plan.attention.id == "flash_bf16") == library
    assert (plan.vision_int8.id == ONEDNN_INT8) == (library and here.exact_int8)
    int4 = choose(shape_on(AVX2, quantize="int4"), here).int4
    tiles_everywhere = "above 0 rows" in int4.kernel or "to 0, int4 tiles" in int4.kernel
    assert tiles_everywhere == library
    assert machines.here() is here  # made once for these overrides


def test_a_measurement_is_made_once_per_machine_and_cached(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu, "cache_dir", lambda: tmp_path)
    calls = []
    monkeypatch.setitem(measure.COMPARISONS, "peaks", lambda: calls.append(1) or {"int8": 1.0})
    key = measure.machine_key(AMX, "AMX")
    assert measure.measured("peaks", key) == measure.measured("peaks", key) == {"int8": 1.0}
    assert len(calls) == 1 and (tmp_path / measure.STORE).is_file()
    measure.measured("peaks", measure.machine_key(AMX, "AVX2"))  # another build: measured again
    measure.measured("peaks", key, again=True)
    assert len(calls) == 3


@pytest.mark.skipif(cpu.why_unavailable() is not None, reason="no build of our kernels")
@pytest.mark.parametrize("build", ["AVX2", "VNNI", "AMX", ""])
def test_the_int8_peak_is_timed_on_int8_linear_c_wherever_our_build_runs(monkeypatch, build):
    # oneDNN's int8 alone gave an AVX2 EPYC a peak of 2 G(OP)/s, int8_linear.c ran at 86
    monkeypatch.setattr(cpu, "name", lambda: build)
    int8 = measure.peak_kernels()["int8"]
    peak_rows = (measure.PEAK_SIDE, measure.PEAK_PROMPT_ROWS)
    ours = {f"int8_linear.c, {rows} rows" for rows in peak_rows} if build else set()
    int4 = {f"int4_vnni.c, {cpu.AMX_ROWS} rows"} if build and cpu.load()[0].int4_vnni else set()
    # oneDNN's where it is exact or alone (a saturating kernel the plan never takes is no peak)
    onednn = {"oneDNN int8"} if cpu_features.exact_int8() or not build else set()
    assert set(int8) == {*onednn, *ours, *int4}
    for name in ours | int4:  # each computes: a kernel that refused its weights would time nothing
        product, ops = int8[name]
        y = product()
        assert 2 * y.shape[0] * y.shape[1] * measure.PEAK_SIDE == ops and y.isfinite().all()


def test_bf16_products_are_float32s_to_bfloat16_rounding_and_few_rows_stay_exact():
    weight = torch.randn(96, 64).bfloat16()
    kernel = matrix.bf16_products(above=8)
    for rows in (4, 40):
        x = torch.randn(rows, 64)
        reference = x @ weight.float().t()
        y = kernel(x, weight, None, None)
        if y is None:  # no C kernels here: the few rows are the layer's own
            assert rows <= 8 and cpu.why_unavailable() is not None
            continue
        tolerance = 0 if rows <= 8 else 2e-2 * reference.abs().max().item()
        assert (y - reference).abs().max().item() <= tolerance + 1e-4


@pytest.mark.skipif(cpu.why_unavailable() is not None, reason="no C kernels here")
def test_bf16_products_hand_their_outputs_on_rounded_for_the_same_bits():
    """A GEMM of bfloat16 products hands its outputs on in bfloat16 (Linear's `rounded`), as
    the next product would round them: the dense MLP and the vision tower's give the bits of
    each product's outputs widened, then rounded again by the next; a few rows, in float32."""
    from mmcli.models.layers.linear import Linear
    from mmcli.models.layers.mlp import MLP

    torch.manual_seed(3)
    mlp, fc1, fc2 = MLP(64, 96), Linear(64, 96), Linear(96, 64)
    for layer in (mlp.gate_proj, mlp.up_proj, mlp.down_proj, fc1, fc2):
        layer.weight.data = layer.weight.data.bfloat16()
        layer.kernel = matrix.bf16_products(above=8)
    mlp.act.kernel = cpu_ops.silu_times
    with torch.inference_mode():
        for rows in (40, 4):
            x = torch.randn(rows, 64)
            handed = fc1(x, activation="gelu_tanh", rounded=True)
            assert handed.dtype == (torch.bfloat16 if rows > 8 else torch.float32)
            assert torch.equal(fc2(handed), fc2(fc1(x, activation="gelu_tanh")))
            gate, up = mlp.gate_proj(x), mlp.up_proj(x)
            assert torch.equal(mlp(x), mlp.down_proj(cpu_ops.silu_times(gate, up)))
        # products the kernel declines (here: not contiguous) are still computed in float32
        gate, up = torch.randn(2, 40, 192).bfloat16()[:, :, ::2]
        expected = F.silu(gate.float()) * up.float()
        assert torch.equal(mlp.act(gate, up), expected)


@pytest.mark.skipif(not cpu_features.exact_int8(), reason="oneDNN's int8 saturates without VNNI")
def test_int8_on_onednn_is_int8_references_arithmetic_exactly():
    weight = quantize_int8(torch.randn(40, 52))
    x = torch.randn(33, 52)
    reference = int8_reference(x, weight, per_token=True)
    assert torch.equal(matrix.int8_rows_matmul(x, as_rows(weight)), reference)
    assert matrix.int8_rows_matmul(x, weight) is None  # not the rows layout
    assert torch.equal(matrix.int8_products(above=16)(x, weight), reference)  # copied to rows


def test_int4_tiles_dequantize_torchs_layout_and_match_its_kernel():
    w = torch.randn(320, 128)
    packed = quantize_int4(w.bfloat16())
    q, scale, zero = int4_values(w.bfloat16())
    expected = ((q.float() - 8).view(320, -1, 32) * scale[..., None] + zero[..., None]).view(
        320, 128
    )
    dequantized = matrix.int4_dequantized(packed, 64, 320).float().t()
    assert torch.allclose(dequantized, expected[64:].bfloat16().float(), atol=2e-2, rtol=1e-2)
    x = torch.randn(300, 128)
    y, reference = matrix.int4_tiles_linear(x, packed, None), int4_linear(x, packed, None)
    assert (y - reference).abs().max() <= 2e-2 * reference.abs().max()
    # float32 products (a CPU without bfloat16's): the dequantized values' products, unrounded
    exact = x.double() @ matrix.int4_dequantized(packed, 0, 320).double()
    float32 = matrix.int4_tiles_linear(x, packed, None, "float32").double()
    torch.testing.assert_close(float32, exact, atol=1e-4, rtol=1e-5)
    assert matrix.int4_matmul(above=512)(x, packed, None) is None  # few rows: torch's kernel


def test_the_int4_layout_is_torchs_here_and_both_its_x86_forms_dequantize():
    """int4_block names torch's packing in this process (64 on AVX-512, 32 on AVX2); the
    dequantizer reads either form, made by hand, as the values they hold."""
    assert weight_forms.int4_block() in (64, 32)  # torch's packer matches one of our forms
    q = torch.randint(0, 16, (192, 96), dtype=torch.int32)
    scales_zeros = torch.randn(96 // 32, 192, 2).bfloat16()
    scale, zero = (scales_zeros[..., i].float().t().repeat_interleave(32, 1) for i in (0, 1))
    expected = ((q.float() - 8) * scale + zero)[64:192].t().bfloat16()
    for block in (64, 32):
        weight = Int4Weight(weight_forms.int4_blocks(q, block), scales_zeros, (192, 96))
        assert torch.equal(matrix.int4_dequantized(weight, 64, 192, block), expected)
        # the blocks form (the AVX2 build's): the same values, and torch's layout back exactly
        blocks = weight.in_blocks(block)
        assert blocks.layout == "blocks" and not torch.equal(blocks.packed, weight.packed)
        back = blocks.torch_form()
        assert torch.equal(back.packed, weight.packed) and torch.equal(
            back.scales_zeros, scales_zeros
        )
        assert torch.equal(matrix.int4_dequantized(blocks, 64, 192, block), expected)


@needs_kernels
def test_int4_tiles_c_dequantizer_gives_the_torch_operations_bits(monkeypatch):
    packed = quantize_int4(torch.randn(384, 96).bfloat16())
    ours = matrix.int4_dequantized(packed, 128, 384)
    monkeypatch.setattr(cpu, "eager", lambda: False)
    assert torch.equal(ours, matrix.int4_dequantized(packed, 128, 384))


@needs_kernels
def test_moe_experts_multiply_their_bfloat16_weights_as_held(monkeypatch):
    experts, hidden, inner = 4, 32, 48
    gate_up = torch.randn(experts, 2 * inner, hidden).bfloat16()
    down = torch.randn(experts, hidden, inner).bfloat16()
    x, chosen = torch.randn(40, hidden), torch.randint(0, experts, (40, 2))
    weights = torch.rand(40, 2)
    kernel = experts_module.bf16_grouped_experts(above=8)
    y = kernel(x, chosen, weights, gate_up, down)
    reference = experts_module.grouped_experts(x, chosen, weights, gate_up, down)
    assert (y - reference).abs().max() <= 3e-2 * reference.abs().max()
    assert kernel(x.double(), chosen, weights, gate_up, down) is None
    plan = choose(shape_on(AMX, sparse=True, fusable_decode=False), machine(AMX, "AMX"))
    assert plan.experts.id == "grouped_loop+onednn_bf16"
    assert plan.experts.kernel == "grouped loop, oneDNN bfloat16 above 16 rows"


def test_bf16_attention_is_float32s_to_bfloat16_rounding():
    q, k, v = torch.randn(40, 4, 32), torch.randn(40, 2, 32), torch.randn(40, 2, 32)
    out = attention.bf16_attention(q, k, v, causal=True)
    reference = attention.sdpa_attention(q, k, v, causal=True)
    assert out.dtype == torch.float32 and (out - reference).abs().max() < 3e-2


AMX_HERE = {"amx_bf16", "amx_int8"} <= cpu_features.real_units()


@pytest.mark.skipif(not AMX_HERE, reason="this CPU has no AMX (oneDNN's AMX kernels untestable)")
@pytest.mark.parametrize("kind", ["bf16", "int8"])
def test_onednn_runs_the_matrix_kernels_on_amx_where_the_cpu_has_it(kind):
    product = {
        "bf16": "import torch.nn.functional as F; a = torch.randn(1024, 1024).bfloat16(); "
        "F.linear(a, a)",
        "int8": "a = torch.ones(1024, 1024, dtype=torch.int8); torch._int_mm(a, a)",
    }[kind]
    out = subprocess.run(
        [sys.executable, "-c", f"import torch; {product}"],
        env={**os.environ, "ONEDNN_VERBOSE": "1"},
        capture_output=True,
        text=True,
        check=True,
    )
    assert "amx" in out.stdout.lower()


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    from mmcli.testing import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("bf16"), dtype="bfloat16")


def _loaded(path, units: cpu_features.CpuFeatures, monkeypatch, **settings):
    """A labeler of `path` as on a CPU with `units`, and its greedy tokens and request of the
    astronaut photo."""
    from mmcli import Labeler
    from mmcli.config import load_config

    monkeypatch.setenv("MMCLI_CPU_FEATURES", ",".join(sorted(units.units)))
    labeler = Labeler.from_pretrained(
        str(path), config=load_config(None, {"device": "cpu", **settings})
    )
    sampling = labeler.sampling(max_new_tokens=16)
    req, _ = labeler.request("k", [photo("astronaut.jpg")], "Describe this image.", sampling)
    return labeler, req, greedy(labeler, req).token_ids


@needs_kernels
def test_norms_hand_their_outputs_on_in_bfloat16_without_moving_a_float(
    bf16_checkpoint, monkeypatch
):
    """hand_on_norms: the norms whose readers all take the `upcast` products, where those round
    their inputs at every row count, give their outputs in bfloat16 (the decoder's input and post
    norms, the vision blocks' two); the final norm (read by the logits' near-float32 products),
    q/k norms and the mergers' do not. Handed on or not, the prompt's logits are the same floats
    (forced on here where this build's few rows would not round, to check it on any CPU)."""
    labeler, req, tokens = _loaded(bf16_checkpoint, AMX, monkeypatch, weights_cache=False)
    model = labeler.model
    decoder, tower = model.language_model, model.visual
    text = [(layer.input_layernorm, layer.post_attention_layernorm) for layer in decoder.layers]
    readers = [norm for pair in text for norm in pair]
    readers += [norm for block in tower.blocks for norm in (block.norm1, block.norm2)]
    others = [decoder.norm, decoder.layers[0].self_attn.q_norm, tower.merger.norm]
    rounds = labeler.kernel_plan.upcast.rounds_inputs
    assert all(n.rounded == rounds for n in readers) and not any(n.rounded for n in others)
    logits = {}
    for handed_on in (True, False):
        for norm in readers:
            norm.rounded = handed_on
        (logits[handed_on],) = forced_logits(labeler, [req], [tokens[:1]])
    assert torch.equal(logits[True], logits[False])


# bfloat16 rounding of the activations moves this checkpoint's logits by 2-4% of their spread;
# a wrong kernel (a layout, a scale) moves them by all of it.
PRODUCTS_MARGIN = 0.1
# int4's step rows on int4_vnni.c are int8 levels per group of 32 inputs, against bfloat16 rows on
# torch's int4 kernel: on an AMX Xeon (whose plan keeps torch's kernel at one row) the two sides'
# logits came 0.12 of their spread apart at most, 0.074 with both on torch's kernel.
INT4_ROWS_MARGIN = 0.25


@needs_kernels
@pytest.mark.parametrize("quantize", ["none", "int8", "int4"])
def test_bfloat16_products_keep_the_float32_products_choices(
    bf16_checkpoint, monkeypatch, quantize
):
    """Teacher-forced along the float32 products' greedy tokens: the bfloat16 products' logits
    within PRODUCTS_MARGIN (int4: INT4_ROWS_MARGIN) of the logits' spread at every step (the
    tiny random checkpoint's next-token distribution is nearly flat: its greedy tokens may flip
    at a near-tie)."""
    # each side's units are a measurement key of their own: the measured choices kept alike
    monkeypatch.setenv("MMCLI_CPU_PREFER", "ours")
    if quantize in ("int8", "int4"):
        # int8's per-token levels (int4's vision tower too) amplify any difference upstream (a
        # 0.2% change flips a level): bfloat16 attention alone moves this checkpoint's int8
        # logits by a third of their spread, torch's flash attention as attention.c's pairs, and
        # so does a cache of keys and values rounded to bfloat16. The linears and the logits are
        # compared here; the pairs' rounding in test_cpu_kernels.py, the cache's in
        # test_fused_decode.py
        float32 = cpu_ops.attention
        monkeypatch.setattr(
            cpu_ops,
            "attention_pairs",
            lambda q, k, v, causal=False, tiles=False: float32(q, k, v, causal),
        )
        monkeypatch.setattr(Precision, "kv_dtype", property(lambda p: p.compute_dtype))
    settings = {"quantize": quantize, "weights_cache": False}
    matrix_run, matrix_req, _ = _loaded(bf16_checkpoint, AMX, monkeypatch, **settings)
    vector_run, vector_req, reference = _loaded(bf16_checkpoint, AVX2, monkeypatch, **settings)
    assert matrix_run.precision.products == "bfloat16"
    assert vector_run.precision.products == "float32"
    if quantize == "none":  # the KV cache in the products' dtype (int8, int4: float32, above)
        assert matrix_run.runner.cache.kv_dtype == torch.bfloat16
        assert vector_run.runner.cache.kv_dtype == torch.float32
    assert matrix_run.kernel_plan.upcast.id.startswith("onednn_bf16+")
    if quantize == "int8":
        layers = [m for m in matrix_run.model.visual.modules() if hasattr(m, "per_token")]
        # our AMX build reads the weights as stored, and so does ours where oneDNN's int8 is
        # not exact; elsewhere oneDNN's int8 reads rows
        layout, kernel = (
            ("interleaved", cpu_ops.int8_matmul)
            if cpu.name() == "AMX" or not cpu_features.exact_int8()
            else ("rows", matrix.int8_rows_matmul)
        )
        assert layers and all(m.weight.layout == layout for m in layers)
        assert all(getattr(m.kernel, "func", m.kernel) is kernel for m in layers)
    (expected,) = forced_logits(vector_run, [vector_req], [reference])
    assert expected.argmax(-1).tolist() == reference  # the forced steps are the engine's
    (logits,) = forced_logits(matrix_run, [matrix_req], [reference])
    margin = INT4_ROWS_MARGIN if quantize == "int4" else PRODUCTS_MARGIN
    assert_same_choices(logits, expected, margin * expected.std().item())
