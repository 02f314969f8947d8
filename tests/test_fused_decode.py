"""The decode step one kernel call a layer (model/fused_decode.py, decode_layer.c) against the
decoder's own modules: the same hidden states, cache contents, logits and greedy tokens."""

import dataclasses

import pytest
import torch
from conftest import assert_same_choices, forced_logits, greedy, photo, with_cpu_kernels

from mmcli.api.labeler import Labeler
from mmcli.kernels import cpu, matrix, weight_forms
from mmcli.kernels.cpu_ops import KERNEL_ROWS
from mmcli.kernels.fused_decode import FusedDecode
from mmcli.models.cache import AttentionBatch, DecoderCache
from mmcli.models.config import TextConfig
from mmcli.models.layers.linear import Linear
from mmcli.models.layers.quantized import Int4Linear
from mmcli.models.qwen3_vl.text import TextDecoder
from mmcli.weights.int4 import adopt, quantize_int4
from mmcli.weights.int8 import quantize_linears

pytestmark = pytest.mark.skipif(
    cpu.why_unavailable() is not None, reason="no AVX2 or no C compiler here"
)


def _decoder(cfg: TextConfig, seed: int) -> TextDecoder:
    """Random weights as a checkpoint holds them: bfloat16 matrices, float32 norms; the layers'
    kernels as the plan installs them, the decode step layer by layer."""
    generator = torch.Generator().manual_seed(seed)
    decoder = TextDecoder(cfg).eval().requires_grad_(False)
    for name, tensor in decoder.named_parameters():
        values = torch.randn(tensor.shape, generator=generator)
        if name.endswith("norm.weight"):
            tensor.data = 1 + 0.1 * values
        else:
            tensor.data = (values * tensor.shape[-1] ** -0.5).bfloat16()
    with_cpu_kernels(decoder).kernel = None
    return decoder


def _config(shape: dict, intermediate_size: int) -> TextConfig:
    """Two layers of `shape` (sizes and heads), the rotary's sections split over head_dim."""
    half = shape["head_dim"] // 2
    return TextConfig(
        **shape,
        intermediate_size=intermediate_size,
        num_hidden_layers=2,
        vocab_size=16,
        mrope_section=(half - 2 * (half // 3), half // 3, half // 3),
    )


def _steps(decoder, cfg, steps: int, prompts: dict[int, int], seed: int, kv_dtype=None):
    """Prompts (cache row: length) written to their rows one at a time, then `steps` decode
    steps of all of them together, rows in the dict's order, each at its own position: each
    step's output and the cache (K/V in `kv_dtype`, float32 where None) after the last."""
    generator = torch.Generator().manual_seed(seed)
    cpu_device = torch.device("cpu")
    cache = DecoderCache(cfg, max(prompts) + 1, 256, torch.float32, cpu_device, kv_dtype)
    longest = max(prompts.values()) + steps
    cos, sin = torch.randn(2, len(prompts), longest, cfg.head_dim, generator=generator)
    hidden = torch.randn(len(prompts), longest, cfg.hidden_size, generator=generator)
    for r, (slot, n) in enumerate(prompts.items()):
        batch = AttentionBatch(slots=torch.tensor([slot]), seqlens=[n])
        decoder(hidden[r, :n], cos[r, :n], sin[r, :n], batch, cache)
    slots, rows = torch.tensor(list(prompts)), torch.arange(len(prompts))
    outs = []
    for step in range(steps):
        positions = torch.tensor(list(prompts.values())) + step
        batch = AttentionBatch(
            slots=slots,
            positions=positions,
            context_len=int(positions.max()) + 1,
            contiguous=list(prompts) == list(range(len(prompts))),
        )
        at = (rows, positions)
        outs.append(decoder(hidden[at], cos[at], sin[at], batch, cache))
    return torch.stack(outs), cache


def test_a_float32_step_of_more_rows_than_the_few_rows_kernels_matches_its_layers(
    build, monkeypatch
):
    """20 sequences in flight, above KERNEL_ROWS (the AVX2 plan's float_rows: a decode step's
    cpu.AMX_ROWS), one decode_layer.c call a layer: the layers' hidden states."""
    shape = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    cfg = _config(shape, intermediate_size=72)
    decoder = _decoder(cfg, seed=3)
    prompts = {slot: 1 + slot % 7 for slot in range(20)}
    reference, _ = _steps(decoder, cfg, steps=4, prompts=prompts, seed=1)
    decoder.kernel = FusedDecode.for_decoder(decoder, cfg, float_rows=cpu.AMX_ROWS)
    assert decoder.kernel.max_rows >= len(prompts) > KERNEL_ROWS
    calls, layer_call = [], cpu.decode_layer
    monkeypatch.setattr(cpu, "decode_layer", lambda *a: calls.append(1) or layer_call(*a))
    fused, _ = _steps(decoder, cfg, steps=4, prompts=prompts, seed=1)
    assert len(calls) == 4 * cfg.num_hidden_layers
    torch.testing.assert_close(fused, reference, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "shape",
    [
        dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32),
        # a head, the hidden and the MLP widths off the vector length; one key head for three
        dict(hidden_size=40, num_attention_heads=3, num_key_value_heads=1, head_dim=24),
        # the released models' head sizes: 128 (three query heads a key head: a pair, then one), 256
        dict(hidden_size=64, num_attention_heads=6, num_key_value_heads=2, head_dim=128),
        dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=256),
    ],
)
@pytest.mark.parametrize("prompts", [{0: 5}, {2: 3, 0: 9, 1: 1}])
def test_the_fused_step_matches_the_layers_it_replaces(build, shape, prompts):
    cfg = _config(shape, intermediate_size=72)
    decoder = _decoder(cfg, seed=shape["head_dim"])
    reference, ref_cache = _steps(decoder, cfg, steps=20, prompts=prompts, seed=1)
    decoder.kernel = FusedDecode.for_decoder(decoder, cfg)
    assert decoder.kernel is not None
    fused, cache = _steps(decoder, cfg, steps=20, prompts=prompts, seed=1)
    torch.testing.assert_close(fused, reference, atol=1e-5, rtol=1e-5)
    for i in range(cfg.num_hidden_layers):
        for ours, theirs in zip(cache.layer(i), ref_cache.layer(i)):
            torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "shape",
    [
        dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32),
        dict(hidden_size=48, num_attention_heads=3, num_key_value_heads=1, head_dim=16),
    ],
)
def test_an_int8_step_matches_the_int8_layers_it_replaces(build, shape):
    """int8 weights (int8_linear.c's layout, no padding): each product's rows quantized once in
    the kernel as each Int8Linear quantizes its own, the same integers summed."""
    cfg = _config(shape, intermediate_size=96)
    decoder = _decoder(cfg, seed=shape["head_dim"])
    assert quantize_linears(decoder) == 7 * cfg.num_hidden_layers
    with_cpu_kernels(decoder, quantize="int8").kernel = None
    prompts = {2: 3, 0: 9, 1: 1}
    reference, ref_cache = _steps(decoder, cfg, steps=12, prompts=prompts, seed=1)
    decoder.kernel = FusedDecode.for_decoder(decoder, cfg)
    assert decoder.kernel is not None and decoder.kernel.structs[0].int8 == 1
    fused, cache = _steps(decoder, cfg, steps=12, prompts=prompts, seed=1)
    torch.testing.assert_close(fused, reference, atol=1e-5, rtol=1e-5)
    for i in range(cfg.num_hidden_layers):
        for ours, theirs in zip(cache.layer(i), ref_cache.layer(i)):
            torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    mixed = _decoder(cfg, seed=shape["head_dim"])  # the last layer's linears kept as loaded
    quantize_linears(mixed, keep=tuple(mixed.layers[-1].modules()))
    with_cpu_kernels(mixed, quantize="int8").kernel = None
    reference, _ = _steps(mixed, cfg, steps=4, prompts=prompts, seed=1)
    mixed.kernel = FusedDecode.for_decoder(mixed, cfg)
    assert [layer.int8 for layer in mixed.kernel.structs] == [1, 0]
    fused, _ = _steps(mixed, cfg, steps=4, prompts=prompts, seed=1)
    torch.testing.assert_close(fused, reference, atol=1e-5, rtol=1e-5)
    padded = dataclasses.replace(cfg, intermediate_size=72)  # out padded to 80: not the kernel's
    decoder = _decoder(padded, seed=0)
    quantize_linears(decoder)
    assert FusedDecode.for_decoder(decoder, padded) is None


def test_only_layers_it_reproduces_take_it():
    cfg = TextConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        intermediate_size=72, num_hidden_layers=2, vocab_size=16, mrope_section=(8, 4, 4),
    )  # fmt: skip
    decoder = _decoder(cfg, seed=0)
    assert FusedDecode.for_decoder(decoder, cfg) is not None
    float32 = _decoder(cfg, seed=0)
    float32.layers[1].mlp.down_proj.weight.data = float32.layers[1].mlp.down_proj.weight.float()
    assert FusedDecode.for_decoder(float32, cfg) is None  # the packed and plain kernels
    partial = dataclasses.replace(cfg, partial_rotary_factor=0.5, mrope_section=(4, 2, 2))
    assert FusedDecode.for_decoder(decoder, partial) is None
    gated = dataclasses.replace(cfg, attn_output_gate=True, norm_unit_offset=True)  # Qwen3.5's
    assert FusedDecode.for_decoder(_decoder(gated, seed=0), gated) is None
    fused = FusedDecode.for_decoder(decoder, cfg)
    hidden, slots = torch.zeros(17, 64), torch.arange(17)
    rows = AttentionBatch(slots[:16], torch.full((16,), 3), context_len=4)
    assert fused.fits(hidden[:16], rows, None)
    assert not fused.fits(hidden, dataclasses.replace(rows, slots=slots), None)  # past 16 rows
    assert not fused.fits(hidden[:16], dataclasses.replace(rows, fixed_shapes=True), None)
    assert not fused.fits(hidden[:16], dataclasses.replace(rows, seqlens=[16]), None)
    cache = DecoderCache(cfg, 2, 4, torch.float32, torch.device("cpu"))
    cos_sin = torch.ones(2, 32)
    past = AttentionBatch(slots[:2], torch.tensor([1, 4]), context_len=5)
    with pytest.raises(IndexError, match=r"decode positions \[1, 4\] outside the cache's 4"):
        fused(hidden[:2], cos_sin, cos_sin, past, cache)
    elsewhere = AttentionBatch(torch.tensor([0, 2]), torch.tensor([1, 2]), context_len=3)
    with pytest.raises(IndexError, match=r"cache rows \[0, 2\] outside its 2 rows"):
        fused(hidden[:2], cos_sin, cos_sin, elsewhere, cache)


# The fused step and the modules' are float32 throughout (vector_units: float32 products; the
# tiles' bfloat16 products are tests/test_amx_kernels.py's): they differ by the sums' order alone.
FUSED_MARGIN = 1e-4


def test_an_ask_decodes_the_same_logits_either_way(bf16_dir, monkeypatch, vector_units):
    """Teacher-forced along the modules' greedy tokens: the fused step's logits within
    FUSED_MARGIN of the modules' at every step."""
    monkeypatch.setenv("MMCLI_CPU_PREFER", "ours")  # the modules' linears in float32 products
    labeler = Labeler.from_pretrained(str(bf16_dir), device="cpu")
    decoder = labeler.model.language_model
    assert decoder.kernel is not None
    assert "decode_step decode_layer.c" in labeler.kernels
    req, _ = labeler.request("k", [photo("chelsea.jpg")], "Describe this image.",
                             labeler.sampling(max_new_tokens=24))  # fmt: skip
    kernel, decoder.kernel = decoder.kernel, None
    tokens = greedy(labeler, req).token_ids
    (reference,) = forced_logits(labeler, [req], [tokens])
    assert reference.argmax(-1).tolist() == tokens and len(tokens) == 24
    decoder.kernel = kernel
    (fused,) = forced_logits(labeler, [req], [tokens])
    assert_same_choices(fused, reference, FUSED_MARGIN)


def test_sequences_decoded_together_get_the_modules_logits(bf16_dir, monkeypatch, vector_units):
    """Three sequences in flight (the batched step, each row at its own position) through the
    fused step: within FUSED_MARGIN of the modules' batched step."""
    # ours whatever this machine measured: oneDNN's bfloat16 products at 3 rows would move the
    # modules' logits by bfloat16 rounding (3e-2), not by the sums' order
    monkeypatch.setenv("MMCLI_CPU_PREFER", "ours")
    labeler = Labeler.from_pretrained(str(bf16_dir), device="cpu")
    decoder = labeler.model.language_model
    questions = ["Describe this image.", "What is it?", "Count the objects, then name each one."]
    requests = [
        labeler.request(f"k{i}", [photo("chelsea.jpg")], q, labeler.sampling(max_new_tokens=12))[0]
        for i, q in enumerate(questions)
    ]
    requests = [dataclasses.replace(r, stop_ids=frozenset()) for r in requests]
    tokens = [d.token_ids for d in sorted(labeler.engine.generate(requests), key=lambda d: d.key)]
    assert all(len(t) == 12 for t in tokens)
    fused = forced_logits(labeler, requests, tokens)
    assert [f.argmax(-1).tolist() for f in fused] == tokens  # the forced steps are the engine's
    decoder.kernel = None
    for logits, reference in zip(fused, forced_logits(labeler, requests, tokens)):
        assert_same_choices(logits, reference, FUSED_MARGIN)


@pytest.mark.skipif(
    cpu.load()[0] is None or not cpu.load()[0].int4_vnni, reason="no int4_vnni.c for this layout"
)
@pytest.mark.parametrize("prompts", [{2: 3, 0: 9, 1: 1, 3: 4}, {0: 5}])
@pytest.mark.parametrize("vnni_rows", [cpu.AMX_ROWS, 0], ids=["vnni", "amx_tiles"])
@pytest.mark.parametrize("blocks", [False, True], ids=["torch_layout", "blocks_form"])
def test_an_int4_step_matches_the_int4_layers_it_replaces(monkeypatch, prompts, vnni_rows, blocks):
    """int4 weights (torch's layout or, where the build reads it, the blocks form) on int4_vnni.c
    in the step as in each Int4Linear (given int4_vnni.c from one row, whatever this CPU's plan
    takes), on the vector units or (the AMX build) the tiles: the same
    products, one sequence or four; with torch's int4 kernel at 1 and 2 rows the step leaves
    those to the modules."""
    if blocks and not cpu.load()[0].int4_blocks:
        pytest.skip("this build reads torch's int4 layout only")
    shape = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    cfg = _config(shape, intermediate_size=128)
    decoder = _decoder(cfg, seed=3)
    linears = [(n, m) for n, m in decoder.named_modules() if isinstance(m, Linear)]
    adopt(decoder, {f"{n}.weight": quantize_int4(m.weight) for n, m in linears}, {})
    with_cpu_kernels(decoder, quantize="int4").kernel = None
    int4_vnni = matrix.int4_matmul(None, vnni_above=0)  # AMX's plan keeps torch's at 1-2 rows
    for layer in decoder.modules():
        if isinstance(layer, Int4Linear):
            layer.kernel = int4_vnni
            if blocks:  # as the loader puts them where the plan says so
                layer.weight = layer.weight.in_blocks(weight_forms.int4_block())
    reference, ref_cache = _steps(decoder, cfg, steps=8, prompts=prompts, seed=1)
    decoder.kernel = FusedDecode.for_decoder(
        decoder, cfg, int4_torch_rows=0, int4_vnni_rows=vnni_rows
    )
    assert decoder.kernel is not None and decoder.kernel.structs[0].int4 == 1
    fused_steps, step = [], FusedDecode.__call__
    monkeypatch.setattr(FusedDecode, "__call__", lambda *a: fused_steps.append(1) or step(*a))
    fused, cache = _steps(decoder, cfg, steps=8, prompts=prompts, seed=1)
    assert len(fused_steps) == 8  # every step, one sequence's too
    torch.testing.assert_close(fused, reference, atol=1e-5, rtol=1e-5)
    for i in range(cfg.num_hidden_layers):
        for ours, theirs in zip(cache.layer(i), ref_cache.layer(i)):
            torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    two = AttentionBatch(slots=torch.tensor([0, 1]), positions=torch.tensor([9, 1]))
    assert decoder.kernel.fits(torch.zeros(2, cfg.hidden_size), two, None)
    torch_rows = FusedDecode.for_decoder(decoder, cfg, int4_torch_rows=cpu.INT4_TORCH_ROWS)
    assert torch_rows.min_rows == cpu.INT4_TORCH_ROWS + 1
    assert not torch_rows.fits(torch.zeros(2, cfg.hidden_size), two, None)


@pytest.mark.parametrize(
    "shape",
    [
        dict(hidden_size=64, num_attention_heads=6, num_key_value_heads=2, head_dim=128),
        # a head off the vector length: the generic loops, their tails
        dict(hidden_size=40, num_attention_heads=3, num_key_value_heads=1, head_dim=24),
    ],
)
def test_a_bfloat16_cache_is_read_and_written_as_the_layers_do(build, shape):
    """A cache of bfloat16 keys and values (a run of bfloat16 products): the kernel rounds what
    it writes to the nearest bfloat16 and widens what it reads, as the layers' torch code does.
    Its float32 inputs differ from the layers' by their sums' order, so a value near a rounding
    boundary may round to the neighbouring bfloat16: the cache is compared within one bfloat16
    step, the outputs within what that step moves them."""
    cfg = _config(shape, intermediate_size=72)
    decoder = _decoder(cfg, seed=shape["head_dim"])
    prompts = {2: 3, 0: 9, 1: 1}
    reference, ref_cache = _steps(decoder, cfg, 20, prompts, seed=1, kv_dtype=torch.bfloat16)
    decoder.kernel = FusedDecode.for_decoder(decoder, cfg)
    fused, cache = _steps(decoder, cfg, 20, prompts, seed=1, kv_dtype=torch.bfloat16)
    for i in range(cfg.num_hidden_layers):
        for ours, theirs in zip(cache.layer(i), ref_cache.layer(i)):
            assert ours.dtype == theirs.dtype == torch.bfloat16
            torch.testing.assert_close(ours.float(), theirs.float(), atol=1e-6, rtol=2**-7)
    torch.testing.assert_close(fused, reference, atol=1e-3, rtol=1e-3)
    # and bfloat16 it is: the same steps over a float32 cache come out elsewhere
    float32, _ = _steps(decoder, cfg, 20, prompts, seed=1)
    assert (float32 - fused).abs().max() > 10 * (fused - reference).abs().max()
