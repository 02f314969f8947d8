"""The kernel plan: which kernel each kind of work uses, chosen once at load from the run's shape,
and installed into the layers that name that work."""

import dataclasses
import functools

import pytest

from mmcli.kernels import cpu, cpu_features, cpu_ops, machine
from mmcli.kernels.attention import bounded_attention
from mmcli.kernels.fused_decode import FusedDecode
from mmcli.kernels.machine import Crossover, Machine, comparisons
from mmcli.kernels.plan import NONE, PACKED, RunShape, choose

DEFAULT = RunShape("cpu", "eager", "float32", "bfloat16", "none", fusable_decode=True)
needs_kernels = pytest.mark.skipif(
    cpu.why_unavailable() is not None, reason="no AVX2 or no C compiler here"
)


def vector_machine(build: str = "AVX2") -> Machine:
    """This CPU as an AVX2 one with our `build`, ours winning every comparison."""
    units = dataclasses.replace(cpu_features.detect(), units=frozenset({"avx2", "fma"}))
    ours = {name: Crossover(None, "ours (by hand)") for name in comparisons(units, build)}
    return Machine(units, build, crossovers=ours)


def test_the_default_cpu_run_takes_our_kernels_for_every_kind_of_work():
    plan = choose(DEFAULT, vector_machine())
    ours = {"upcast", "attention", "norm", "rotary", "swiglu", "decode_step"}
    assert all(plan.choices()[work].install is not None for work in ours)
    assert plan.record()["norm"] == "rms_norm.c" and plan.record()["build"] == "AVX2"
    assert plan.int8 is NONE and plan.experts is NONE and plan.delta_rule is NONE
    assert "int8" not in plan.record() and "decode_step decode_layer.c" in plan.summary()


def test_without_our_kernels_every_layer_keeps_torch():
    units = vector_machine().cpu
    none = Machine(units, "", "MMCLI_CPU_KERNEL=0", {"int4_tiles": Crossover(None, "")})
    plan = choose(DEFAULT, none)
    assert plan.build == "none (MMCLI_CPU_KERNEL=0)"
    assert all(c.install is None for w, c in plan.choices().items() if w != "vision_blocks")
    assert plan.upcast.id == "chunks" and plan.decode_step.id == "layer_by_layer"


def test_units_the_cpu_lacks_are_never_timed(monkeypatch):
    """MMCLI_CPU_FEATURES may claim units this CPU does not have (tests plan for other CPUs so):
    the library would emulate them, so nothing is measured and ours is taken; a mask within the
    CPU's own units is measured as ever."""
    from mmcli.kernels import measure

    timed = []
    result = {"kernels": ["ours", "library"], "rates": {8: (2.0, 1.0)}}
    monkeypatch.setattr(measure, "measured", lambda name, key: timed.append(name) or result)
    monkeypatch.setattr(machine, "_made", functools.cache(machine._made.__wrapped__))
    real = cpu_features.real_units()
    lacking = sorted({"amx_bf16", "amx_int8", "avx512_bf16", "avx512_vnni"} - real)
    monkeypatch.setenv("MMCLI_CPU_FEATURES", ",".join(sorted(real | set(lacking))))
    claimed = machine.here()
    if lacking:
        assert claimed.crossovers and not timed
        why = {c.why for c in claimed.crossovers.values()}
        assert why == {f"nothing measured: {', '.join(lacking)} not on this CPU"}
        assert all(c.above is None for c in claimed.crossovers.values())
    monkeypatch.setenv("MMCLI_CPU_FEATURES", ",".join(sorted(real)))
    own = machine.here()
    assert sorted(timed) == sorted(own.crossovers)
    assert all(c.why.startswith("measured here: ours vs library") for c in own.crossovers.values())


@pytest.mark.parametrize("backend", ["inductor", "neuron"])
def test_compiled_graphs_trace_torch_operations(backend):
    plan = choose(RunShape("cpu", backend, "float32", "float32", "none"), vector_machine())
    assert {plan.norm.id, plan.attention.id, plan.rotary.id} == {"torch"}
    assert plan.linears.id == "as_loaded" and plan.decode_step.install is None
    if backend == "inductor":  # neuron's kernel needs torch-neuronx to be installed
        assert plan.vision_blocks.install(None) is bounded_attention


def test_quantized_runs_keep_the_upcast_kernel_for_the_matrices_left_as_loaded():
    shape = dataclasses.replace(DEFAULT, quantize="int8", hybrid=True, fusable_decode=False)
    int8 = choose(shape, vector_machine())
    assert int8.int8.install(None) is cpu_ops.int8_matmul and int8.upcast.install is not None
    assert int8.linears.id == "int8" and int8.delta_rule.install(None)[1] is cpu_ops.delta_step
    shape = dataclasses.replace(DEFAULT, quantize="int4", sparse=True, fusable_decode=False)
    int4 = choose(shape, vector_machine())
    assert int4.upcast.install is not None and int4.experts.id == "grouped_loop"


def test_a_gpu_run_is_planned_without_building_or_measuring(monkeypatch):
    monkeypatch.setattr(cpu, "load", None)
    off = machine.for_device("cuda")
    assert not off.build and not off.crossovers
    plan = choose(dataclasses.replace(DEFAULT, device="cuda", compute="bfloat16"), off)
    assert plan.build == "none (not on the CPU)" and plan.norm.id == "torch"


@needs_kernels
def test_a_loaded_run_holds_its_plan_and_its_layers_the_plans_kernels(tiny_dir, tmp_path):
    from mmcli import Labeler
    from mmcli.testing import make_tiny_checkpoint

    labeler = Labeler.from_pretrained(
        str(make_tiny_checkpoint(tmp_path / "bf16", dtype="bfloat16")), device="cpu"
    )
    decoder = labeler.model.language_model
    products = labeler.precision.products  # bfloat16 where the CPU multiplies it
    here = machine.here()
    assert labeler.kernel_plan == choose(dataclasses.replace(DEFAULT, products=products), here)
    assert decoder.layers[0].input_layernorm.kernel is cpu_ops.rms_norm
    assert decoder.layers[0].self_attn.rotary.kernel is cpu_ops.rotary
    assert decoder.layers[0].mlp.act.kernel is cpu_ops.silu_times
    assert isinstance(decoder.kernel, FusedDecode)
    assert labeler.kernels == labeler.kernel_plan.summary()
    float32 = Labeler.from_pretrained(str(tiny_dir), dtype="float32", device="cpu")
    assert float32.kernel_plan.linears.id == PACKED
    assert float32.model.language_model.kernel is None  # decode_layer.c reads bfloat16 weights
