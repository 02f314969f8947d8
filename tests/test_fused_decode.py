"""The decode step one kernel call a layer (model/fused_decode.py, decode_layer.c) against the
decoder's own modules: the same hidden states, cache contents, logits and greedy tokens."""

import dataclasses

import pytest
import torch
from conftest import greedy, photo

from mmcli.api.labeler import Labeler
from mmcli.model import cpu_kernel
from mmcli.model.cache import AttentionBatch, DecoderCache
from mmcli.model.config import TextConfig
from mmcli.model.fused_decode import FusedDecode
from mmcli.model.text import TextDecoder
from mmcli.testing import make_tiny_checkpoint

pytestmark = pytest.mark.skipif(
    cpu_kernel.why_unavailable() is not None, reason="no AVX2 or no C compiler here"
)


def _decoder(cfg: TextConfig, seed: int) -> TextDecoder:
    """Random weights as a checkpoint holds them: bfloat16 matrices, float32 norms."""
    generator = torch.Generator().manual_seed(seed)
    decoder = TextDecoder(cfg).eval().requires_grad_(False)
    for name, tensor in decoder.named_parameters():
        values = torch.randn(tensor.shape, generator=generator)
        if name.endswith("norm.weight"):
            tensor.data = 1 + 0.1 * values
        else:
            tensor.data = (values * tensor.shape[-1] ** -0.5).bfloat16()
    return decoder


def _steps(decoder, cfg, positions: int, prefix: int, seed: int):
    """A prompt of `prefix` tokens written to the cache, then `positions` decode steps: each
    step's output and the cache after the last."""
    generator = torch.Generator().manual_seed(seed)
    cache = DecoderCache(cfg, 1, 256, torch.float32, torch.device("cpu"))
    slots = torch.zeros(1, dtype=torch.long)
    cos_sin = torch.randn(2, prefix + positions, cfg.head_dim, generator=generator)
    hidden = torch.randn(prefix + positions, cfg.hidden_size, generator=generator)
    decoder(hidden[:prefix], cos_sin[0, :prefix], cos_sin[1, :prefix],
            AttentionBatch(slots=slots, seqlens=[prefix]), cache)  # fmt: skip
    outs = []
    for pos in range(prefix, prefix + positions):
        batch = AttentionBatch(
            slots=slots, positions=torch.tensor([pos]), context_len=pos + 1, contiguous=True
        )
        step = slice(pos, pos + 1)
        outs.append(decoder(hidden[step], cos_sin[0, step], cos_sin[1, step], batch, cache))
    return torch.cat(outs), cache


@pytest.mark.parametrize(
    "shape",
    [
        dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32),
        # a head, the hidden and the MLP widths off the vector length; one key head for three
        dict(hidden_size=40, num_attention_heads=3, num_key_value_heads=1, head_dim=24),
    ],
)
def test_the_fused_step_matches_the_layers_it_replaces(build, shape):
    half = shape["head_dim"] // 2
    cfg = TextConfig(
        **shape,
        intermediate_size=72,
        num_hidden_layers=2,
        vocab_size=16,
        mrope_section=(half - 2 * (half // 3), half // 3, half // 3),
    )
    decoder = _decoder(cfg, seed=shape["head_dim"])
    reference, ref_cache = _steps(decoder, cfg, positions=20, prefix=5, seed=1)
    decoder.fused_decode = FusedDecode.for_decoder(decoder, cfg)
    assert decoder.fused_decode is not None
    fused, cache = _steps(decoder, cfg, positions=20, prefix=5, seed=1)
    torch.testing.assert_close(fused, reference, atol=1e-5, rtol=1e-5)
    for i in range(cfg.num_hidden_layers):
        for ours, theirs in zip(cache.layer(i), ref_cache.layer(i)):
            torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


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
    fused = FusedDecode.for_decoder(decoder, cfg)
    hidden, slots = torch.zeros(2, 64), torch.zeros(2, dtype=torch.long)
    two_rows = AttentionBatch(slots, torch.tensor([3, 4]), context_len=5, contiguous=True)
    assert not fused.fits(hidden, two_rows, None)
    one_row = AttentionBatch(slots[:1], torch.tensor([3]), context_len=4, contiguous=True)
    assert fused.fits(hidden[:1], one_row, None)
    assert not fused.fits(hidden[:1], dataclasses.replace(one_row, fixed_shapes=True), None)
    cache = DecoderCache(cfg, 1, 4, torch.float32, torch.device("cpu"))
    cos_sin = torch.ones(1, 32)
    past = dataclasses.replace(one_row, positions=torch.tensor([4]), context_len=5)
    with pytest.raises(IndexError, match="decode position 4 outside the cache's 4 columns"):
        fused(hidden[:1], cos_sin, cos_sin, past, cache)


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("fused") / "m", dtype="bfloat16")


def test_an_ask_decodes_the_same_tokens_and_logprobs_either_way(bf16_dir):
    labeler = Labeler.from_pretrained(str(bf16_dir), device="cpu")
    decoder = labeler.model.language_model
    assert decoder.fused_decode is not None
    assert "a decode step one call a layer" in labeler.runner.kernels
    req, _ = labeler.request("k", [photo("chelsea.jpg")], "Describe this image.",
                             labeler.sampling(max_new_tokens=24))  # fmt: skip
    fused = greedy(labeler, req)
    decoder.fused_decode = None
    reference = greedy(labeler, req)
    assert fused.token_ids == reference.token_ids and len(fused.token_ids) == 24
    assert max(abs(a - b) for a, b in zip(fused.logprobs, reference.logprobs)) < 1e-4
