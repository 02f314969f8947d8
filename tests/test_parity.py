"""Parity with transformers' Qwen3-VL on tiny random checkpoints, float32."""

import dataclasses

import pytest
import torch
from conftest import VARIANTS, hf_model, hf_processor, photo, prefill_logits

from mmcli.api.labeler import Labeler

CASES = {
    "text_only": [],
    "one_image": ["chelsea.jpg"],
    "two_images": ["astronaut.jpg", "coffee.jpg"],
}
QUESTION = "Describe this image."


@pytest.fixture(scope="module", params=VARIANTS)
def pair(request, variant_dirs):
    path = variant_dirs[request.param]
    return (
        Labeler.from_pretrained(str(path), dtype="float32", device="cpu"),
        hf_model(path),
        hf_processor(path),
    )


def _reference_inputs(processor, images):
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": QUESTION}]
    text = processor.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
    return processor(text=[text], images=images or None, return_tensors="pt")


def _prefill_logits(captioner, req, rotary=None):
    return prefill_logits(captioner, req, rotary)


@pytest.mark.parametrize("case", CASES)
def test_ids_positions_logits_and_greedy_tokens(pair, case):
    captioner, model, processor = pair
    images = [photo(n) for n in CASES[case]]
    ref = _reference_inputs(processor, images)
    req, _ = captioner.request("k", images, QUESTION, captioner.sampling(max_new_tokens=32))

    assert req.input_ids == ref["input_ids"][0].tolist()
    if images:
        torch.testing.assert_close(
            torch.cat(req.pixel_values), ref["pixel_values"], atol=1e-6, rtol=0
        )
        assert [list(g) for g in req.vision_grids] == ref["image_grid_thw"].tolist()
    positions, deltas = model.model.get_rope_index(
        ref["input_ids"],
        ref["mm_token_type_ids"],
        ref.get("image_grid_thw"),
        attention_mask=ref["attention_mask"],
    )
    assert torch.equal(req.rotary_position_ids, positions[:, 0]) and req.rope_delta == int(deltas)

    with torch.no_grad():
        ref_logits = model(**ref).logits[0]
    torch.testing.assert_close(_prefill_logits(captioner, req), ref_logits, atol=1e-4, rtol=0)

    from transformers import GenerationConfig

    gen = GenerationConfig(
        max_new_tokens=32,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    # 32 tokens on both sides, whatever a random model emits
    model.generation_config.eos_token_id = None
    out = model.generate(**ref, generation_config=gen)
    ref_tokens = out.sequences[0, ref["input_ids"].shape[1] :].tolist()
    ref_logprobs = [
        torch.log_softmax(step[0], -1)[t].item() for step, t in zip(out.logits, ref_tokens)
    ]
    done = next(iter(captioner.engine.generate([dataclasses.replace(req, stop_ids=frozenset())])))
    assert len(ref_tokens) == 32 and done.token_ids == ref_tokens
    assert max(abs(a - b) for a, b in zip(done.logprobs, ref_logprobs)) < 1e-3


def test_one_dimensional_image_positions_would_fail_parity(pair):
    """The trap: sequential positions for image tokens (what transformers 5.x computed when
    called without mm_token_type_ids; 5.23 now refuses such a call) must be caught by the logits
    check above."""
    captioner, model, processor = pair
    images = [photo("chelsea.jpg")]
    ref = _reference_inputs(processor, images)
    req, _ = captioner.request("k", images, QUESTION, captioner.sampling())
    with torch.no_grad():
        ref_logits = model(**ref).logits[0]
        flat = torch.arange(len(req.input_ids)).expand(3, -1)
        silent_1d = model(**ref, position_ids=flat[:, None, :]).logits[0]
    ours_1d = _prefill_logits(captioner, req, rotary=flat)
    assert (ours_1d - ref_logits).abs().max() > 1e-3  # would fail the 1e-4 parity check
    # and it is what the trap computes
    torch.testing.assert_close(ours_1d, silent_1d, atol=1e-4, rtol=0)
