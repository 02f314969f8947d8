"""int4_vnni.c, int4 weights on the vector units' int8 dot products, where the build reads
torch's int4 layout (AVX-512 VNNI and VBMI's 64 channels a block, AVX2's 32). A decode step's few
rows: against float64 with each row quantized to int8 per group of 32 inputs as the kernel
quantizes it, within 1% of the unquantized rows, the same values on the AMX build's tiles; torch's
int4 kernel keeps a single sequence's rows. A prompt's many rows, widened to int8 for
int8_linear.c's tiles (127 levels with VBMI, 63 on AVX2): each weight within half a level of its
int4 value, against float64 with each row quantized to 8 bits as the kernel quantizes it."""

import dataclasses
import re
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import int4_values_f64

from mmcli.kernels import cpu, cpu_ops, weight_forms
from mmcli.models.layers.quantized import int4_linear
from mmcli.weights.int4 import quantize_int4

LIBRARY = cpu.load()[0]
VNNI_HERE = LIBRARY is not None and LIBRARY.int4_vnni
pytestmark = pytest.mark.skipif(not VNNI_HERE, reason="no int4_vnni.c for torch's layout here")
WIDENED = pytest.mark.skipif(
    not (VNNI_HERE and LIBRARY.int4_widened), reason="tiles wider than torch's blocks here"
)


def _quantized(w: torch.Tensor) -> weight_forms.Int4Weight:
    """w's 4 bits as the loader holds them for this build (the blocks form on AVX2)."""
    return cpu.int4_read_form(quantize_int4(w))


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


# rows in one pass of 4 and in several (the last one short), the tiles' one 16-row pass and two;
# one group, 32 (the tiles' chunks of three groups, the last one short) and 9 (every chunk full)
@pytest.mark.parametrize("rows", [3, 4, 5, 8, 17, 32])
@pytest.mark.parametrize("channels,inputs", [(64, 32), (192, 1024), (128, 9 * 32)])
def test_int4_at_a_few_rows_multiplies_its_weights_by_int8_rows(rows, channels, inputs):
    generator = torch.Generator().manual_seed(rows)
    weight = _quantized(torch.randn(channels, inputs, generator=generator).bfloat16())
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
    if cpu.name() == "AMX":  # the AMX build's vector units or tiles: the same integers and floats
        for vnni_rows in (cpu.AMX_ROWS, 0):
            assert torch.equal(cpu_ops.amx_int4_matmul(x, weight, bias, vnni_rows), got)


def _q(weight) -> torch.Tensor:
    """An Int4Weight's q [out, in] (0..15), read back from torch's layout here."""
    out, inner = weight.shape
    block = weight_forms.int4_block()
    packed = weight.packed.view(out // block, inner, block // 2)
    return torch.cat([packed & 0xF, packed >> 4], -1).permute(0, 2, 1).reshape(out, inner)


@pytest.mark.parametrize("rows", [1, 2, 3, 8])
def test_avx2s_blocks_of_32_give_the_floats_of_this_builds_blocks(monkeypatch, rows):
    """AVX2's build reads torch's AVX2 layout (32 channels a block) on vpmaddubsw: on any CPU,
    the same integers and floats as int4_vnni.c on the layout torch packs here."""
    weight = _quantized(torch.randn(192, 1024, generator=torch.Generator().manual_seed(2)))
    x = torch.randn(rows, 1024)
    here = cpu.int4_vnni_linear(x, weight)
    by_32 = dataclasses.replace(weight, packed=weight_forms.int4_blocks(_q(weight), 32))
    by_32 = by_32.in_blocks(32)  # the form the AVX2 build reads fastest
    monkeypatch.setenv("MMCLI_CPU_KERNEL", "avx2")
    cpu.load.cache_clear()
    try:
        library = cpu.load()[0]
        got = cpu._int4_products(library.int4_vnni_rows, x, by_32)
    finally:
        monkeypatch.undo()
        cpu.load.cache_clear()
    assert torch.equal(got, here)


def test_the_blocks_form_gives_the_same_floats_where_the_build_reads_it():
    """The AVX2 half reads torch's layout or the blocks form (the loader's, where its kernels are
    the weights' only readers): the same floats at a step's rows and widened at a prompt's. A
    build that reads torch's layout only refuses the blocks form; torch's int4 kernel then takes
    the weight in its own layout, with the same products from either form."""
    weight = quantize_int4(torch.randn(64, 256).bfloat16())
    blocks = weight.in_blocks(weight_forms.int4_block())
    assert blocks.layout == "blocks" and not torch.equal(blocks.packed, weight.packed)
    for rows in (1, 3, cpu.AMX_ROWS + 8):
        x = torch.randn(rows, 256)
        got = cpu.int4_int8_linear(x, blocks)
        if LIBRARY.int4_blocks:
            assert torch.equal(got, cpu.int4_int8_linear(x, weight))
        else:
            assert got is None
        assert torch.equal(int4_linear(x, blocks, None), int4_linear(x, weight, None))


def test_shapes_off_its_blocks_are_refused():
    weight = _quantized(torch.randn(64, 64).bfloat16())
    assert cpu.int4_vnni_linear(torch.randn(4, 64), weight) is not None
    odd = _quantized(torch.randn(48, 64).bfloat16())  # channels not a multiple of 64
    assert cpu.int4_vnni_linear(torch.randn(4, 64), odd) is None


@pytest.mark.parametrize("build", [[], cpu.AMX_FLAGS], ids=["AVX2", "AMX"])
def test_the_next_blocks_scales_are_fetched_ahead_in_each_build(tmp_path, build):
    """The compiled kernel holds the prefetches of the next block's scales and zeros: GCC drops
    a call to a helper whose only effect is a prefetch where it has not inlined it first, and
    both builds had lost them so (int4's step at one row took 1.2x as long on an AMX Xeon)."""
    source = Path(cpu.__file__).parent / "csrc" / "int4_vnni.c"
    assembly = tmp_path / "int4_vnni.s"
    command = [cpu.compiler(), *cpu.FLAGS, *build, "-S", str(source), "-o", str(assembly)]
    made = subprocess.run(command, capture_output=True, text=True)
    if made.returncode and build:  # an older compiler: the loader falls back to AVX2's build
        pytest.skip(f"{cpu.compiler()} does not take the AMX build's flags: {made.stderr[:200]}")
    assert made.returncode == 0, made.stderr
    # a block's scales and zeros of a group: 128 bytes (AVX2's 32 channels) or 256, a line at a
    # time (the tiles' into L1); the weights' bytes ahead are fetched from the pointer itself
    text = assembly.read_text()
    assert re.search(r"prefetcht2\s+64\(", text)
    if build:
        assert re.search(r"prefetcht0\s+64\(", text)


def _8bit_rows(x: torch.Tensor) -> torch.Tensor:
    """x as the widened products quantize it: each row to 8 bits, scale its largest value over
    127 (at least 1e-12; float32 arithmetic, ties to even), dequantized in float64."""
    scale = (x.abs().amax(-1, keepdim=True) / 127).clamp_min(1e-12)
    return torch.round(x / scale).double() * scale.double()


def _widened_level(weight) -> torch.Tensor:
    """Each channel's int8 level: the largest magnitude its groups' values can reach over the
    build's largest level (127, or 63 on AVX2)."""
    sz = weight.torch_form().scales_zeros.double()  # [in / 32, out, 2]
    scale, zero = sz[..., 0], sz[..., 1]
    reach = torch.maximum((zero - 8 * scale).abs(), (zero + 7 * scale).abs())
    return reach.amax(0).clamp_min(1e-12) / LIBRARY.int4_widened_top


# more rows than a decode step's: the tiles' 6-row passes and a short last one; one group, many,
# and more inputs than the tiles take at once (their int32 sums kept in y between blocks)
@WIDENED
@pytest.mark.parametrize("rows", [cpu.AMX_ROWS + 1, 64, 70])
@pytest.mark.parametrize("channels,inputs", [(64, 32), (192, 1024), (64, 8192 + 32)])
def test_int4_at_a_prompts_rows_is_widened_to_int8(rows, channels, inputs):
    generator = torch.Generator().manual_seed(rows)
    weight = _quantized(torch.randn(channels, inputs, generator=generator).bfloat16())
    x = torch.randn(rows, inputs, generator=generator)
    x[1] = 0  # a row of zeros: nothing divided by its scale
    values, level = int4_values_f64(weight).t(), _widened_level(weight)
    xq = _8bit_rows(x)
    got = cpu.int4_int8_linear(x, weight).double()
    assert torch.equal(got, cpu.int4_widened_linear(x, weight).double())
    if cpu.name() == "AMX":  # a prompt's rows there: the same, on the tiles where K fits them
        assert torch.equal(cpu.amx_int4_gemm(x, weight).double(), got)
    # every widened weight within half a level (and float32's rounding of its level) of its value
    exact = xq @ values
    assert ((got - exact).abs() <= xq.abs().sum(-1, keepdim=True) * 0.5001 * level + 1e-4).all()
    # against the unquantized rows and weights: 1-2% of the products here at 127 levels, 1.2-2.1%
    # at AVX2's 63 (a channel's level set by its largest group's reach, 257 groups at most here)
    unquantized = x.double() @ values
    margin = 0.02 if LIBRARY.int4_widened_top == 127 else 0.03
    assert (got - unquantized).norm() < margin * unquantized.norm()


@WIDENED
def test_rows_past_l2_give_the_floats_of_the_rows_a_few_at_a_time():
    """More rows than L2 holds (2 MiB of 8-bit rows: the AMX build widens the whole weight once
    for int8_linear.c's chunks of rows, where fewer take a block at a time): each row's floats
    are those it gets among a few rows, every build."""
    generator = torch.Generator().manual_seed(5)
    weight = _quantized(torch.randn(192, 8192, generator=generator).bfloat16())
    x = torch.randn(300, 8192, generator=generator)  # 2.3 MiB of levels
    few = torch.cat([cpu.int4_widened_linear(rows, weight) for rows in x.split(64)])
    assert torch.equal(cpu.int4_widened_linear(x, weight), few)


def test_a_decode_steps_rows_stay_quantized_per_group():
    weight = _quantized(torch.randn(64, 256).bfloat16())
    x = torch.randn(cpu.AMX_ROWS, 256)
    assert torch.equal(cpu.int4_int8_linear(x, weight), cpu.int4_vnni_linear(x, weight))
