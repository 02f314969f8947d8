"""amx.c's kernels on the AMX tiles, where this CPU has them: bfloat16 products against float64
with each activation rounded as the kernel rounds it, the split products within 16 bits of each
activation, int4's few rows against their int8 rows, int8 the very integers of the VNNI build,
and the fused decode step on the tiles against the decoder's modules."""

import pytest
import torch
from conftest import (
    assert_bfloat16_products,
    assert_fused_step_keeps_the_modules_choices,
    int4_values_f64,
)

from mmcli.kernels import cpu, cpu_ops, matrix, measure
from mmcli.weights.int4 import quantize_int4

# the AMX build: this CPU's tiles, not masked (MMCLI_CPU_FEATURES) or forced away (MMCLI_CPU_KERNEL)
AMX_HERE = cpu.has_amx() and cpu.why_unavailable() is None
pytestmark = pytest.mark.skipif(not AMX_HERE, reason="no AMX build here")


@pytest.fixture
def amx_build():
    cpu.load.cache_clear()
    assert cpu.name() == "AMX", cpu.load()[1]
    yield
    cpu.load.cache_clear()


# rows across the 16 columns of a B tile and past them; channels in 1 and 4-block passes;
# inputs of one and of many 32-input steps
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 32])
@pytest.mark.parametrize("channels,inputs", [(16, 32), (80, 96), (1024, 2048)])
def test_tile_products_are_bfloat16_products_summed_in_float32(amx_build, rows, channels, inputs):
    assert_bfloat16_products(cpu.amx_bf16_linear, rows, channels, inputs)


def test_shapes_off_the_tiles_are_refused_and_the_callers_fall_back(amx_build):
    x, weight = torch.randn(4, 64), torch.randn(48, 64).bfloat16()
    assert cpu.amx_bf16_linear(torch.randn(4, 40), torch.randn(48, 40).bfloat16(), False) is None
    assert cpu.amx_bf16_linear(x, torch.randn(40, 64).bfloat16(), False) is None
    assert cpu.amx_bf16_linear(torch.randn(33, 64), weight, True) is None  # 66 columns
    assert cpu.amx_bf16_linear(torch.randn(64, 64), weight, False) is not None
    # the callers take bf16_linear.c's float32 products where the tiles do not
    many = torch.randn(40, 64)
    torch.testing.assert_close(
        cpu_ops.bf16_rows_matmul(many, weight, split=True),
        cpu_ops.bf16_matmul(many, weight, None, None),
    )


@pytest.mark.parametrize("rows", [5, 7, 16, 17, 32, 33, 600])
@pytest.mark.parametrize("channels,inputs", [(64, 32), (192, 1024)])
def test_int4_on_the_tiles_multiplies_its_weights(amx_build, monkeypatch, rows, channels, inputs):
    """amx.c's int4 products: the integers to INT4_FEW_ROWS rows, panels dequantized to bfloat16
    above, as a build without int4_vnni.c takes them (with it, more rows are widened to int8:
    test_int4_vnni.py)."""
    monkeypatch.setattr(cpu.load()[0], "int4_vnni", False)
    generator = torch.Generator().manual_seed(rows)
    weight = quantize_int4(torch.randn(channels, inputs, generator=generator).bfloat16())
    x, bias = torch.randn(rows, inputs, generator=generator), torch.randn(channels)
    dequantized = matrix.int4_dequantized(weight, 0, channels).double()  # [inputs, channels]
    exact = x.bfloat16().double() @ dequantized + bias.double()
    magnitude = x.abs().double() @ dequantized.abs()
    got = cpu_ops.amx_int4_matmul(x, weight, bias).double()
    if rows <= cpu.INT4_FEW_ROWS:  # the weights' exact values, not rounded to bfloat16
        exact = x.bfloat16().double() @ int4_values_f64(weight).t() + bias.double()
    assert ((got - exact).abs() <= 4e-6 * magnitude + 1e-5).all()


# the last shape's outputs (4.5 MB) are stored past the caches (vectors.h's STREAM_BYTES)
@pytest.mark.parametrize(
    "rows,channels,inputs",
    [(r, *shape) for r in (1, 5, 16, 17, 40, 300) for shape in ((64, 64), (192, 1024))]
    + [(1100, 1024, 64)],
)
@pytest.mark.parametrize("activation", [None, "gelu_tanh"])
def test_int8_on_the_tiles_gives_the_vnni_builds_very_values(
    monkeypatch, rows, channels, inputs, activation
):
    generator = torch.Generator().manual_seed(rows)
    weight, _ = measure.random_int8(channels, inputs)
    weight.bias.normal_(generator=generator)
    x = torch.randn(rows, inputs, generator=generator)
    cpu.load.cache_clear()
    tiles = cpu.int8_linear(x, weight, vnni_rows=0, activation=activation)  # at every row count
    assert torch.equal(cpu_ops.int8_matmul(x, weight, activation), tiles)  # as a run takes them
    monkeypatch.setattr(cpu, "has_amx", lambda: False)
    monkeypatch.setattr(cpu, "has_bf16_dot", lambda: False)
    cpu.load.cache_clear()
    assert cpu.name() == "AVX-512 VNNI"
    vectors = cpu_ops.int8_matmul(x, weight, activation)
    monkeypatch.undo()
    cpu.load.cache_clear()
    assert torch.equal(tiles, vectors)


# bfloat16 products on both sides, rounded at different places (the modules' oneDNN GEMM rounds
# its outputs past 16 rows), of the logits' spread: measured up to 0.08 of it at 20 sequences; a
# wrong layout or scale moves them by all of it
TILES_MARGIN = 0.2


@pytest.mark.parametrize("batch", [6, 20])
def test_the_fused_step_on_the_tiles_keeps_the_modules_choices(amx_build, bf16_dir, batch):
    """`batch` sequences decoded together (the fused step on the tiles; at 20, past
    KERNEL_ROWS, the modules on oneDNN's GEMM) against the decoder's modules, teacher-forced on
    the modules' tokens."""
    assert_fused_step_keeps_the_modules_choices(bf16_dir, batch, "AMX tiles", TILES_MARGIN)
