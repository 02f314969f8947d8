"""int4_vnni.c, int4 weights times a decode step's few rows on the vector units' int8 dot
products, where this CPU has AVX-512 VNNI and VBMI: against float64 with each row quantized to
int8 per group of 32 inputs as the kernel quantizes it, within 1% of the unquantized rows, the
same values on the AMX build's dispatch; and torch's int4 kernel keeps a single sequence's rows."""

import pytest
import torch
from conftest import int4_values_f64

from mmcli.kernels import cpu, cpu_ops
from mmcli.weights.int4 import quantize_int4

VNNI_HERE = cpu.why_unavailable() is None and cpu.has_vnni() and cpu.has_vbmi()
pytestmark = pytest.mark.skipif(not VNNI_HERE, reason="this CPU has no AVX-512 VNNI and VBMI")


def _int8_levels(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x as int4_vnni.c quantizes it: each group of 32 inputs to int8 levels, scale its largest
    value over 127 (float32 arithmetic, ties to even): (levels, largest) by group."""
    groups = x.reshape(x.shape[0], -1, 32)
    largest = groups.abs().amax(-1, keepdim=True)
    inverse = torch.where(largest > 0, 127 / largest, torch.zeros_like(largest))
    return torch.round(groups * inverse), largest


def _int8_groups(x: torch.Tensor) -> torch.Tensor:
    """x quantized as int4_vnni.c quantizes it, dequantized in float64."""
    q, largest = _int8_levels(x)
    return (q.double() * (largest / 127).double()).reshape(x.shape)


def test_rows_are_quantized_to_the_levels_of_float32_arithmetic_ties_to_even():
    """The vector quantizer's levels, scales and sums are exactly the scalar arithmetic's, at
    ties (halves of a level) and in a group of zeros too."""
    x = torch.randn(5, 256)
    x[1] = torch.arange(256.0).remainder(64) - 31.5  # halves: ties, each group's largest 127
    x[1, ::32] = 127.0
    x[2, :32] = 0
    levels, scales, sums = cpu.int4_quantize_rows(x)
    q, largest = _int8_levels(x)
    assert torch.equal(levels.reshape(q.shape).float(), q)
    assert torch.equal(scales, (largest / 127).reshape(scales.shape))
    assert torch.equal(sums, q.sum(-1).int())


# rows in one pass of 4 and in several (the last one short); one group and many
@pytest.mark.parametrize("rows", [3, 4, 5, 8, 17, 32])
@pytest.mark.parametrize("channels,inputs", [(64, 32), (192, 1024)])
def test_int4_at_a_few_rows_multiplies_its_weights_by_int8_rows(rows, channels, inputs):
    generator = torch.Generator().manual_seed(rows)
    weight = quantize_int4(torch.randn(channels, inputs, generator=generator).bfloat16())
    x, bias = torch.randn(rows, inputs, generator=generator), torch.randn(channels)
    x[0, :32] = 0  # a group of zeros: scale 0, nothing divided by it
    values = int4_values_f64(weight).t()
    exact = _int8_groups(x) @ values + bias.double()
    magnitude = x.abs().double() @ values.abs()
    got = cpu_ops.int4_vnni_matmul(x, weight, bias)
    assert ((got.double() - exact).abs() <= 4e-6 * magnitude + 1e-5).all()
    # against the unquantized rows: int8 per group of 32 is about 1% of the products' magnitude
    unquantized = x.double() @ values + bias.double()
    assert ((got.double() - unquantized).abs() <= 0.01 * magnitude + 1e-5).all()
    assert cpu_ops.int4_vnni_matmul(x[:2], weight, bias) is None  # torch's kernel there
    # where the plan gives it a step's fewest rows too: each row's products the same bits
    assert torch.equal(cpu_ops.int4_vnni_matmul(x[:1], weight, bias, torch_rows=0), got[:1])
    if cpu.name() == "AMX" and rows <= cpu.INT4_VNNI_ROWS:  # the AMX build's few rows: the same
        assert torch.equal(cpu_ops.amx_int4_matmul(x, weight, bias), got)


def test_shapes_off_its_blocks_are_refused():
    weight = quantize_int4(torch.randn(64, 64).bfloat16())
    assert cpu.int4_vnni_linear(torch.randn(4, 64), weight) is not None
    odd = quantize_int4(torch.randn(48, 64).bfloat16())  # channels not a multiple of 64
    assert cpu.int4_vnni_linear(torch.randn(4, 64), odd) is None
