"""bf16_dot.c's kernel on AVX-512 BF16's dot products, where this CPU has them: bfloat16 products
against float64 with each activation rounded as the kernel rounds it, the split products within
16 bits of each activation, a row's products the same bits whichever rows share its call, and the
fused decode step on them against the decoder's modules."""

import pytest
import torch
from conftest import (
    assert_bfloat16_products,
    assert_fused_step_keeps_the_modules_choices,
)

from mmcli.kernels import cpu, cpu_features, cpu_ops

# the CPU's units, and no other build forced (MMCLI_CPU_KERNEL=avx2): the fixture masks AMX itself
DOT_HERE = {"avx512_bf16", "avx512_vnni"} <= cpu_features.real_units() and cpu.has_vnni()
pytestmark = pytest.mark.skipif(
    not DOT_HERE or cpu.why_unavailable() is not None, reason="this CPU has no AVX-512 BF16"
)


@pytest.fixture
def bf16_build(monkeypatch):
    """Our AVX-512 BF16 build (on an AMX CPU too: its tiles masked)."""
    units = cpu_features.real_units() - {"amx_bf16", "amx_int8"}
    monkeypatch.setenv("MMCLI_CPU_FEATURES", ",".join(sorted(units)))
    cpu.load.cache_clear()
    assert cpu.name() == "AVX-512 BF16", cpu.load()[1]
    yield
    monkeypatch.undo()
    cpu.load.cache_clear()


# rows across the tiles' 1-4 and past 32; channels off and on a block of 16; inputs off a step
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 16, 33])
@pytest.mark.parametrize("channels,inputs", [(16, 32), (37, 45), (1024, 2048)])
def test_dot_products_are_bfloat16_products_summed_in_float32(bf16_build, rows, channels, inputs):
    assert_bfloat16_products(cpu.bf16_dot_linear, rows, channels, inputs)


def test_a_rows_products_do_not_depend_on_the_rows_beside_it(bf16_build):
    """Each output is summed alone, in one order: the same bits at 1, 3 or 32 rows a call."""
    x, weight = torch.randn(32, 200), torch.randn(70, 200).bfloat16()
    together = cpu.bf16_dot_linear(x, weight, False)
    for rows in (1, 3, 7):
        alone = cpu.bf16_dot_linear(x[:rows].contiguous(), weight, False)
        assert torch.equal(alone, together[:rows])
    assert torch.equal(cpu_ops.bf16_rows_matmul(x, weight, split=False), together)


# bfloat16 products on both sides, rounded at different places (the modules' oneDNN GEMM rounds
# its outputs past 16 rows, the fused step's attention sums in another order), of the logits'
# spread; a wrong layout or scale moves them by all of it
DOT_MARGIN = 0.2


@pytest.mark.parametrize("batch", [5, 20])
def test_the_fused_step_on_dot_products_keeps_the_modules_choices(bf16_build, bf16_dir, batch):
    """`batch` sequences decoded together on the fused step (bf16_dot.c's products) against the
    decoder's modules, teacher-forced on the modules' tokens."""
    words = "AVX-512 BF16 dot products"
    assert_fused_step_keeps_the_modules_choices(bf16_dir, batch, words, DOT_MARGIN)
