"""The compiled CPU kernels for float32 compute (bf16_linear.c's GEMM, attention.c) against
float64 references, in this CPU's build and the AVX2 one; the layers that call them."""

import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import with_cpu_kernels

from mmcli.kernels import cpu, cpu_ops, delta_rule, matrix
from mmcli.kernels.attention import bounded_attention, cache_attention, segment_attention
from mmcli.models.layers.attention import RangeAttention
from mmcli.models.layers.linear import Linear, PackedLinear
from mmcli.weights.int8 import int8_linear, quantize_int8

pytestmark = pytest.mark.skipif(
    cpu.why_unavailable() is not None, reason="no AVX2 or no C compiler here"
)


def full_attention(q, k, v, causal=False):
    """The layers' attention within one range, with the kernel the plan installs."""
    return with_cpu_kernels(RangeAttention())(q, k, v, causal)


# rows off the 6-row tiles; channels off the 64- (AVX2: 16-) channel panels and their vectors;
# inputs off the vectors and, at 2100, across two 2048-input panels
@pytest.mark.parametrize("rows,channels,inputs", [(25, 70, 21), (31, 130, 300), (7, 64, 2100)])
def test_the_bf16_gemm_computes_bfloat16_weights_in_float32(build, rows, channels, inputs):
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, inputs, generator=generator)
    weight = torch.randn(channels, inputs, generator=generator).bfloat16()
    bias = torch.randn(channels, generator=generator)
    exact = x.double() @ weight.double().t()
    tolerance = {"atol": 2e-6 * inputs**0.5, "rtol": 1e-5}
    torch.testing.assert_close(cpu.bf16_gemm(x, weight, None).double(), exact, **tolerance)
    with_bias = cpu.bf16_gemm(x, weight, bias, "gelu_tanh").double()
    expected = F.gelu(exact + bias.double(), approximate="tanh")
    torch.testing.assert_close(with_bias, expected, **tolerance)


def test_the_fused_gelu_is_within_a_few_ulp_everywhere(build):
    """Through an identity weight: the tanh-form GELU of values from -12 to 12 within 16 ulp of
    float64 (torch's own float32 GELU is off by far more for negative inputs); huge values stay
    finite."""
    values = torch.linspace(-12, 12, 64 * 500).view(500, 64)
    values[0, :4] = torch.tensor([-1e4, -100.0, 100.0, 1e4])
    out = cpu.bf16_gemm(values, torch.eye(64).bfloat16(), None, "gelu_tanh").double()
    exact = F.gelu(values.double(), approximate="tanh")
    meaningful = exact.abs() > 1e-6
    ulps = (out - exact).abs() / (exact.abs() * 2**-23)
    assert ulps[meaningful].max() < 16 and torch.isfinite(out).all()
    assert out[0, 2] == 100.0 and out[0, 3] == 1e4 and out[0, :2].abs().max() < 1e-30


# e^a and 2^a over the softmax's, GELU's and SiLU's arguments far below zero: how many results
# are subnormal (fpclassify), printed by a small program of vectors.h's
EXPONENTIALS = r"""
#include <math.h>
#include <stdio.h>
#include "vectors.h"
int main(void) {
    float in[GL], e[GL], two[GL];
    int subnormal = 0;
    for (float a = -1000.0f; a <= 0.0f; a += 1.0f / 64) {
        for (int i = 0; i < GL; i++) in[i] = a - i / 1024.0f;
        vstore(e, vexp(vload(in)));
        vstore(two, vexp2_softmax(vload(in)));
        for (int i = 0; i < GL; i++)
            subnormal += (fpclassify(e[i]) == FP_SUBNORMAL) + (fpclassify(two[i]) == FP_SUBNORMAL);
    }
    printf("%d\n", subnormal);
    return 0;
}
"""


@pytest.mark.parametrize("wide", [False, True], ids=["AVX2", "AVX-512"])
def test_the_exponentials_never_return_a_subnormal(tmp_path, wide):
    """vexp and vexp2_softmax stop at a normal float: a subnormal result, or an operand made from
    one (1 + e^-x), costs a microcode assist of a hundred cycles or more, and GELU on a GEMM's
    outputs of deviation 32 took 7-10x as long so."""
    if wide and not cpu.has_vnni():
        pytest.skip("no AVX-512 here")
    source, program = tmp_path / "exponentials.c", tmp_path / "exponentials"
    source.write_text(EXPONENTIALS)
    headers = Path(cpu.__file__).parent / "csrc"
    flags = [*cpu.FLAGS, *(cpu.VNNI_FLAGS if wide else [])]
    command = [cpu.compiler(), *flags, f"-I{headers}", str(source), "-o", str(program), "-lm"]
    made = subprocess.run(command, capture_output=True, text=True)
    assert made.returncode == 0, made.stderr
    ran = subprocess.run([str(program)], capture_output=True, text=True, check=True)
    assert int(ran.stdout) == 0


@pytest.mark.parametrize("kernel", ["upcast", "packed", "plain", "int8"])
def test_every_linear_kernel_applies_the_activation_it_is_asked_for(kernel):
    """Linear(x, activation="gelu_tanh") is GELU of Linear(x), fused or not (100 rows: the
    upcast path's GEMM)."""
    generator = torch.Generator().manual_seed(3)
    layer = Linear(48, 80).requires_grad_(False)
    layer.weight.data = torch.randn(80, 48, generator=generator)
    layer.bias.data = torch.randn(80, generator=generator)
    if kernel == "upcast":
        layer.weight.data = layer.weight.data.bfloat16()
        with_cpu_kernels(layer)
    elif kernel == "packed":
        layer = PackedLinear(layer)
    elif kernel == "int8":
        layer = with_cpu_kernels(int8_linear(layer), quantize="int8")
    x = torch.randn(100, 48, generator=generator)
    expected = F.gelu(layer(x), approximate="tanh")
    torch.testing.assert_close(layer(x, activation="gelu_tanh"), expected, atol=1e-5, rtol=1e-5)


def _attention_inputs(queries, keys, heads, d, seed):
    """q, k, v as the vision tower holds them: views into one [positions, 3, heads, d] tensor."""
    generator = torch.Generator().manual_seed(seed)
    qkv = torch.randn(max(queries, keys), 3, heads, d, generator=generator)
    return qkv[:queries, 0], qkv[:keys, 1], qkv[:keys, 2]


# queries across the 96-query blocks; keys off the key panels; head sizes off the vectors;
# one head on two threads (the head's blocks shared out)
@pytest.mark.parametrize(
    "queries,keys,heads,d", [(100, 130, 3, 64), (33, 17, 2, 80), (200, 300, 1, 128), (5, 1, 2, 8)]
)
def test_the_attention_kernel_matches_sdpa_in_float64(build, queries, keys, heads, d):
    q, k, v = _attention_inputs(queries, keys, heads, d, queries)
    exact = F.scaled_dot_product_attention(
        *(t.double().transpose(0, 1) for t in (q, k, v))
    ).transpose(0, 1)
    torch.testing.assert_close(cpu.attention(q, k, v).double(), exact, atol=2e-6, rtol=0)
    torch.testing.assert_close(full_attention(q, k, v).double(), exact, atol=2e-6, rtol=0)


# the decoder's prefill: causal, GQA (heads / kv heads query heads a key head), with and without
# a cached prefix (keys before the queries' own), queries across the 96-query blocks, one key head
# on two threads
@pytest.mark.parametrize(
    "queries,prefix,heads,kv_heads,d",
    [(219, 0, 4, 2, 128), (100, 37, 6, 3, 64), (9, 0, 2, 1, 80), (1, 5, 2, 2, 16)],
)
def test_causal_grouped_attention_matches_sdpa_in_float64(
    build, queries, prefix, heads, kv_heads, d
):
    generator = torch.Generator().manual_seed(queries)
    q = torch.randn(queries, heads, d, generator=generator)
    # k and v as the KV cache holds them: [kv heads, positions, d], transposed
    k, v = torch.randn(2, kv_heads, prefix + queries + 3, d, generator=generator)
    k, v = k[:, : prefix + queries].transpose(0, 1), v[:, : prefix + queries].transpose(0, 1)
    seen = torch.arange(prefix + queries)[None, :] <= prefix + torch.arange(queries)[:, None]
    exact = F.scaled_dot_product_attention(
        *(t.double().transpose(0, 1) for t in (q, k, v)), attn_mask=seen, enable_gqa=True
    ).transpose(0, 1)
    for attended in (cpu.attention(q, k, v, causal=True), full_attention(q, k, v, True)):
        torch.testing.assert_close(attended.double(), exact, atol=2e-6, rtol=0)


@pytest.mark.parametrize(
    "products",
    [
        pytest.param(
            "pairs", marks=pytest.mark.skipif(not cpu.has_attention_pairs(), reason="no pairs")
        ),
        pytest.param(
            "tiles",
            marks=pytest.mark.skipif(not cpu.has_attention_pairs(tiles=True), reason="no tiles"),
        ),
    ],
)
@pytest.mark.parametrize(
    "queries,keys,heads,kv_heads,d,causal",
    [
        (100, 131, 3, 3, 64, False),
        (219, 219, 4, 2, 128, True),
        (9, 14, 2, 1, 72, True),
        (40, 500, 2, 2, 64, True),  # a cached prefix: keys past the last tile of pairs
    ],
)
def test_attention_on_bfloat16_pairs_is_the_rounded_inputs_attention(
    queries, keys, heads, kv_heads, d, causal, products
):
    """q, k, v rounded to bfloat16, the probabilities too (on AVX-512 BF16's dot products or the
    AMX tiles): within the probabilities' rounding (2^-9 of each, relative: 2^-9 of the largest
    value at most) of float64 attention on the rounded q, k, v."""
    generator = torch.Generator().manual_seed(queries)
    q = torch.randn(queries, heads, d, generator=generator)
    k, v = torch.randn(2, keys, kv_heads, d, generator=generator)
    seen = torch.arange(keys)[None, :] <= keys - queries + torch.arange(queries)[:, None]
    rounded = (t.bfloat16().double().transpose(0, 1) for t in (q, k, v))
    exact = F.scaled_dot_product_attention(
        *rounded, attn_mask=seen if causal else None, enable_gqa=True
    ).transpose(0, 1)
    got = cpu.attention(q, k, v, causal, products).double()
    assert (got - exact).abs().max() <= 2**-9 * v.abs().max()


def test_full_attention_without_the_kernel_is_the_same_causal_attention(monkeypatch):
    """SDPA, where the kernel does not load: its is_causal aligns the queries with the first keys,
    so a cached prefix takes a mask; fewer key heads take enable_gqa."""
    q, k, v = _attention_inputs(20, 20, 4, 32, 5)
    cases = [(q[12:], k, v), (q, k[:, :2], v[:, :2])]
    with_kernel = [full_attention(*case, causal=True) for case in cases]
    without = RangeAttention()  # no kernel installed: SDPA
    for case, expected in zip(cases, with_kernel):
        torch.testing.assert_close(without(*case, causal=True), expected)


def test_one_image_in_one_block_attends_in_one_call_as_the_reference_does():
    q, k, v = (t.transpose(0, 1)[None] for t in _attention_inputs(50, 50, 2, 64, 7))
    bound_min, bound_max = torch.zeros(1, 50, dtype=torch.long), torch.full((1, 50), 50)
    torch.testing.assert_close(
        segment_attention(q, k, v, bound_min, bound_max),
        bounded_attention(q, k, v, bound_min, bound_max),
        atol=1e-6,
        rtol=1e-6,
    )


# widths off the vectors; rows across the threads' threshold; rows a view's stride apart
@pytest.mark.parametrize("rows,width,strided", [(1, 2048, False), (16, 70, True), (300, 256, True)])
def test_the_rms_norm_kernel_matches_float64(build, rows, width, strided):
    generator = torch.Generator().manual_seed(width)
    x = torch.randn(rows, width + 5 if strided else width, generator=generator)[:, :width] * 3
    weight = torch.randn(width, generator=generator)
    exact = weight.double() * (
        x.double() / (x.double().pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()
    )
    torch.testing.assert_close(cpu.rms_norm(x, weight, 1e-6).double(), exact, atol=1e-6, rtol=1e-6)


def test_the_decoder_norm_takes_the_kernel_and_keeps_the_reference_result(monkeypatch):
    """RMSNorm on q's heads ([tokens, heads, d]) through rms_norm.c, against torch's own."""
    from mmcli.models.layers.norms import RMSNorm

    norm = with_cpu_kernels(RMSNorm(64, 1e-6).requires_grad_(False))
    norm.weight.data = torch.randn(64)
    x = torch.randn(7, 4, 64)
    called, original = [], cpu.rms_norm
    monkeypatch.setattr(cpu, "rms_norm", lambda *a: called.append(1) or original(*a))
    expected = F.rms_norm(x, (64,), norm.weight, 1e-6)
    torch.testing.assert_close(norm(x), expected, atol=1e-6, rtol=1e-6)
    assert called


# rows below and past the threads' threshold (2^16 values)
@pytest.mark.parametrize("rows,width", [(3, 64), (300, 1024)])
def test_the_add_and_norm_kernels_give_the_add_then_the_norm(build, rows, width):
    """rms_norm.c's and layer_norm.c's residual add with the norm after it, one pass: the sum the
    floats of x + update (a product's bfloat16 outputs widened, float32, or none); the RMSNorm the
    floats of rms_norm.c's own norm of that sum, the LayerNorm within float32's rounding of
    float64's; rounded to bfloat16, the bits of torch's rounding of those."""
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, width, generator=generator) * 3 + 1
    weight, bias = torch.randn(2, width, generator=generator)
    updates = torch.randn(2, rows, width, generator=generator)
    for update in (updates[0].bfloat16(), updates[1], None):
        total = x if update is None else x + update.float()
        summed, normed = cpu.add_rms_norm(x, update, weight, 1e-6, False)
        assert torch.equal(summed, total)
        assert torch.equal(normed, cpu.rms_norm(total, weight, 1e-6))
        assert torch.equal(cpu.add_rms_norm(x, update, weight, 1e-6, True)[1], normed.bfloat16())
        summed, normed = cpu.add_layer_norm(x, update, weight, bias, 1e-6, False)
        exact = F.layer_norm(total.double(), (width,), weight.double(), bias.double(), 1e-6)
        assert torch.equal(summed, total)
        torch.testing.assert_close(normed.double(), exact, atol=1e-5, rtol=1e-5)
        rounded = cpu.add_layer_norm(x, update, weight, bias, 1e-6, True)[1]
        assert torch.equal(rounded, normed.bfloat16())


def test_the_norm_layers_take_the_residual_add_through_the_kernels_or_torch():
    """add_and_norm: (x + update, its norm) through the installed kernels, the output in bfloat16
    where the plan sets `rounded`; without a kernel, and for rows the kernels decline (70 wide,
    off their vectors), torch's add and norm: the same sum, the norm within float32's rounding
    (the kernels' bits against the unfused norm's: above)."""
    from mmcli.models.layers.norms import LayerNorm, RMSNorm

    generator = torch.Generator().manual_seed(9)
    for width in (64, 70):
        x, update = torch.randn(2, 5, width, generator=generator)
        for make in (lambda w: RMSNorm(w, 1e-6), lambda w: LayerNorm(w, eps=1e-6)):
            plain, fused = make(width).requires_grad_(False), with_cpu_kernels(make(width))
            fused.requires_grad_(False).load_state_dict(plain.state_dict())
            expected_sum, expected = plain.add_and_norm(x, update.bfloat16())
            summed, normed = fused.add_and_norm(x, update.bfloat16())
            assert torch.equal(summed, expected_sum) and torch.equal(summed, x + update.bfloat16())
            torch.testing.assert_close(normed, expected, atol=1e-5, rtol=1e-5)
            fused.rounded = True
            dtype = torch.bfloat16 if width % cpu.NORM_WIDTH == 0 else torch.float32
            assert fused.add_and_norm(x, update)[1].dtype == fused(x).dtype == dtype


def _torch_rotary(x, cos, sin):
    """rotate_half's rotary, as transformers writes it, in float64; partial: the rest passes."""
    rot, half = cos.shape[-1], cos.shape[-1] // 2
    x, cos, sin = x.double(), cos.double()[..., None, :], sin.double()[..., None, :]
    head = x[..., :rot]
    rotated = torch.cat([-head[..., half:], head[..., :half]], dim=-1)
    return torch.cat([head * cos + rotated * sin, x[..., rot:]], dim=-1)


# q out of a fused qkv (rows 3 heads apart), the vision tower's 4-D blocks, a head wider than the
# rotary (Qwen3.5's partial rotary), halves off the vectors
ROTARY_CASES = [((50, 16, 64), 64, True), ((2, 9, 3, 40), 40, False), ((7, 2, 48), 12, True)]


@pytest.mark.parametrize("shape,rot,fused", ROTARY_CASES)
def test_the_rotary_kernel_matches_rotate_half_in_float64(build, monkeypatch, shape, rot, fused):
    from mmcli.models.layers.rotary import Rotary

    apply_rotary = with_cpu_kernels(Rotary())
    generator = torch.Generator().manual_seed(rot)
    *lead, heads, d = shape
    x = torch.randn(*lead, 3 if fused else 1, heads, d, generator=generator).select(-3, 0)
    cos, sin = torch.randn(2, *lead, rot, generator=generator)
    called, original = [], cpu.rotary
    monkeypatch.setattr(cpu, "rotary", lambda *a: called.append(1) or original(*a))
    out = apply_rotary(x, cos, sin)
    assert called and out.shape == x.shape
    torch.testing.assert_close(out.double(), _torch_rotary(x, cos, sin), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("shape,rot,fused", ROTARY_CASES)
def test_the_rotary_takes_the_heads_norm_and_bfloat16_products_in_its_pass(
    build, shape, rot, fused
):
    """The rotary with Qwen3's q/k norm before it (`norm`), from float32 or a product's bfloat16
    outputs handed on: the floats of rms_norm.c's norm of each head then the rotary, one after
    the other; a Qwen3.5 norm ((1 + weight), which the kernel does not take) applied first."""
    from mmcli.models.layers.norms import RMSNorm
    from mmcli.models.layers.rotary import Rotary

    rotary = with_cpu_kernels(Rotary())
    generator = torch.Generator().manual_seed(rot)
    *lead, heads, d = shape
    x = torch.randn(*lead, 3 if fused else 1, heads, d, generator=generator).select(-3, 0)
    cos, sin = torch.randn(2, *lead, rot, generator=generator)
    for offset in (False, True):
        norm = with_cpu_kernels(RMSNorm(d, 1e-6, unit_offset=offset)).requires_grad_(False)
        norm.weight.data = torch.randn(d, generator=generator)
        for handed in (x, x.bfloat16()):
            expected = rotary(norm(handed.float()), cos, sin)
            assert torch.equal(rotary(handed, cos, sin, norm), expected)
        assert torch.equal(rotary(x.bfloat16(), cos, sin), rotary(x.bfloat16().float(), cos, sin))


def test_the_swiglu_kernel_matches_silu_times_up(build, monkeypatch):
    from mmcli.models.layers.mlp import SiluAndMul

    silu_times = with_cpu_kernels(SiluAndMul())
    called, original = [], cpu.silu_times
    monkeypatch.setattr(cpu, "silu_times", lambda *a: called.append(1) or original(*a))
    generator = torch.Generator().manual_seed(0)
    # past the threads' threshold, and a length off the vectors
    for shape in [(219, 600), (3, 21)]:
        gate, up = torch.randn(2, *shape, generator=generator) * 4
        expected = F.silu(gate.double()) * up.double()
        torch.testing.assert_close(
            silu_times(gate.clone(), up).double(), expected, atol=1e-6, rtol=1e-6
        )
    assert len(called) == 2


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "heads, d", [(8, 64), (6, 64), (8, 48)], ids=["pairs_of_heads", "a_lone_head", "48_values"]
)
def test_a_decode_steps_attention_over_the_cache_is_torchs(build, kv_dtype, heads, d):
    """decode_layer.c's attention alone (Qwen3.5's gated attention layers and the sparse models'
    decode through it) against torch's: rows out of order at their own positions, grouped query
    heads (4 or 3 a key head: the AVX2 build scores them in pairs, and one alone), heads of 64
    values and of 48 (the AVX2 build's values 16 at a time past its blocks of 64), the new keys
    and values written into the cache as torch writes them."""
    from mmcli.models.cache import AttentionBatch

    g = torch.Generator().manual_seed(0)
    rows, kv_heads, columns = 3, 2, 40
    q = torch.randn(rows, heads, d, generator=g)
    k, v = (torch.randn(rows, kv_heads, d, generator=g) for _ in range(2))
    caches = [torch.randn(5, kv_heads, columns, d, generator=g).to(kv_dtype) for _ in range(2)]
    positions = torch.tensor([7, 30, 0])
    batch = AttentionBatch(torch.tensor([4, 0, 2]), positions, context_len=31)
    expected_caches = [c.clone() for c in caches]
    expected = cache_attention(q, k, v, batch, *expected_caches)
    out = cpu_ops.cache_attention(q, k, v, batch, *caches)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert all(torch.equal(c, e) for c, e in zip(caches, expected_caches))
    fixed = AttentionBatch(batch.slots, positions, context_len=31, fixed_shapes=True)
    assert cpu_ops.cache_attention(q, k, v, fixed, *caches) is None  # a graph's: torch's


def test_the_delta_rule_step_advances_the_states_rows_in_place_as_pytorchs(build):
    """delta_rule.c's decode step against PyTorch's: the rows named (out of order) advanced in
    place, the others untouched; outputs and states within float32's rounding of the same sums
    (the kernel decays and reads along k in one pass)."""
    g = torch.Generator().manual_seed(0)
    rows, key_heads, heads, dk, dv = 3, 2, 4, 16, 48  # two value heads a key head
    query, key = (torch.randn(rows, key_heads, dk, generator=g) for _ in range(2))
    value = torch.randn(rows, heads, dv, generator=g)
    decay, beta = -2 * torch.rand(rows, heads, generator=g), torch.rand(rows, heads, generator=g)
    states = torch.randn(5, heads, dk, dv, generator=g)
    slots, before = torch.tensor([3, 0, 4]), states.clone()
    expected_states = states.clone()
    expected = delta_rule.step(query, key, value, decay, beta, expected_states, slots)
    out = cpu_ops.delta_step(query, key, value, decay, beta, states, slots)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(states, expected_states, atol=1e-5, rtol=1e-5)
    assert torch.equal(states[1:3], before[1:3])
    odd = torch.randn(rows, heads, dv + 4, generator=g)  # a head the kernel's vectors do not fit
    assert cpu_ops.delta_step(query, key, odd, decay, beta, states, slots) is None


def test_a_bfloat16_gemms_outputs_widen_with_their_bias_and_gelu_in_one_pass(build):
    """oneDNN's bfloat16 products widened to float32 (exactly), the bias added (the same bits as
    torch's), GELU's tanh form within float32's rounding of float64's; the kernel taken by
    matrix.bf16_linear, past the threads' threshold and off the vectors' width."""
    generator = torch.Generator().manual_seed(5)
    for rows, cols in [(219, 600), (3, 21)]:
        products = torch.randn(rows, cols, generator=generator).mul_(4).bfloat16()
        bias = torch.randn(cols, generator=generator)
        torch.testing.assert_close(
            cpu.widen_outputs(products, bias, None), products.float() + bias, atol=0, rtol=0
        )
        assert torch.equal(cpu.widen_outputs(products, None, None), products.float())
        expected = F.gelu(products.double() + bias.double(), approximate="tanh")
        gelu = cpu.widen_outputs(products, bias, "gelu_tanh").double()
        torch.testing.assert_close(gelu, expected, atol=1e-6, rtol=1e-6)
    x, weight, bias = torch.randn(5, 64), torch.randn(40, 64).bfloat16(), torch.randn(40)
    expected = cpu.widen_outputs(F.linear(x.bfloat16(), weight), bias, "gelu_tanh")
    assert torch.equal(matrix.bf16_linear(x, weight, bias, "gelu_tanh"), expected)


def test_a_gemms_outputs_are_handed_on_as_the_next_product_rounds_them(build):
    """`rounded`: the widened outputs (bias, GELU) rounded to bfloat16 in the same pass, and the
    SwiGLU of two products' outputs rounded: the bits of float32's pass then torch's rounding (a
    NaN stays one), past the threads' threshold and off the vectors' width."""
    generator = torch.Generator().manual_seed(6)
    for rows, cols in [(219, 600), (3, 21)]:
        products, up = torch.randn(2, rows, cols, generator=generator).mul_(4).bfloat16()
        products[rows - 1, cols - 2] = float("nan")
        bias = torch.randn(cols, generator=generator)
        for activation in (None, "gelu_tanh"):
            rounded = cpu.widen_outputs(products, bias, activation, rounded=True)
            widened = cpu.widen_outputs(products, bias, activation).bfloat16()
            assert rounded.dtype == torch.bfloat16
            torch.testing.assert_close(rounded, widened, atol=0, rtol=0, equal_nan=True)
        swiglu = cpu.silu_times(products.float(), up.float()).bfloat16()
        torch.testing.assert_close(
            cpu.silu_times_rounded(products, up), swiglu, atol=0, rtol=0, equal_nan=True
        )


@pytest.mark.parametrize("rows", [1, 2, 3, 6, 9])
def test_the_logits_int8_kernel_sums_its_14_bit_rows_exactly(build, rows):
    """int8_linear.c's wide rows (the int8 logits'): each row's int16 levels (its largest
    magnitude at 8191) times the int8 weights, summed in int32 a block of 4096 inputs at a time
    (two blocks here), are float64's sums of the same integers, scaled, to float32's rounding."""
    generator = torch.Generator().manual_seed(5)
    w, bias = torch.randn(48, 4100, generator=generator), torch.randn(48, generator=generator)
    weight = quantize_int8(w, bias)
    x = torch.randn(rows, 4100, generator=generator) * torch.linspace(0.1, 3, 4100)
    scale = x.abs().amax(1, keepdim=True) / 8191  # as the kernel divides, in float32
    levels = torch.round(x / scale).double()
    exact = levels @ weight.rows()[:48, :4100].double().T
    exact = exact * scale.double() * weight.scale[:48].double() + bias.double()
    ours = cpu.int8_wide_linear(x, weight)[:, :48].double()
    assert (ours - exact).abs().max() <= 1e-6 * exact.abs().max()


def test_the_kernels_give_the_same_bits_on_any_number_of_threads(build):
    """The threads take panels, tiles and heads as they come free, so who computes what changes
    from call to call; every sum is still made in one order: one thread and three (more than
    this machine's cores, handed out unevenly) agree to the bit."""
    generator = torch.Generator().manual_seed(11)
    x = torch.randn(37, 300, generator=generator)
    weight = torch.randn(650, 300, generator=generator).bfloat16()
    q, k, v = (torch.randn(150, heads, 32, generator=generator) for heads in (4, 2, 2))
    int8 = quantize_int8(weight.float())

    def outputs():
        return [
            cpu.bf16_gemm(x, weight, None, "gelu_tanh"),
            cpu.bf16_linear(x[:3].contiguous(), weight),
            cpu.attention(q, k, v, causal=True),
            cpu.int8_linear(x, int8),
            cpu.int8_linear(x, int8, activation="gelu_tanh"),
            cpu.int8_wide_linear(x, int8),
        ]

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = outputs()
        torch.set_num_threads(3)
        for _ in range(3):
            assert all(torch.equal(a, b) for a, b in zip(alone, outputs()))
    finally:
        torch.set_num_threads(threads)


def test_a_compiler_that_fails_leaves_the_portable_path_and_says_why(tmp_path, monkeypatch):
    """The sources compile at once, one process each (here a compiler that fails on one and
    does nothing for the others); where one fails, the build stops, no library is left in the
    cache, and load() says which step failed, in the compiler's own words."""
    compiler = tmp_path / "cc"
    compiler.write_text(
        '#!/bin/sh\ncase "$*" in *attention.c*) echo "attention.c: no room" >&2; exit 1;; esac\n'
    )
    compiler.chmod(0o755)
    monkeypatch.setenv("CC", str(compiler))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    cpu.load.cache_clear()
    try:
        library, reason = cpu.load()
    finally:
        monkeypatch.undo()
        cpu.load.cache_clear()
    assert library is None and "failed" in reason and "attention.c: no room" in reason
    assert not list((tmp_path / "cache").rglob("*.so"))
