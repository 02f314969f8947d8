"""Qwen3.5 (hybrid Gated DeltaNet) against transformers' reference, float32, on tiny random
checkpoints whose weights transformers itself wrote; the engine's per-slot linear states."""

import dataclasses

import pytest
import torch
from conftest import (
    assert_logits_match,
    greedy,
    hf_model,
    hf_processor,
    photo,
    reference_greedy,
    reference_prompt_ids,
)

from mmcli.api.labeler import Labeler
from mmcli.compiled.steps import prefill_step
from mmcli.config import GROWN_SEQS
from mmcli.engine.batch import PrefillItem
from mmcli.engine.positions import mrope_cos_sin
from mmcli.kernels import delta_rule
from mmcli.testing import QWEN3_5_VARIANTS, make_test_video

QUESTION = "Describe this image."
LONG = " ".join(["What is in the picture? A cat sits on a red sofa near the window."] * 8)
CASES = {
    "one_image": (["chelsea.jpg"], QUESTION),
    "two_images": (["astronaut.jpg", "coffee.jpg"], QUESTION),
    "long_text_with_an_image": (["rocket.jpg"], LONG),
    "text_only": ([], QUESTION),
}
TOKENS = 16


@pytest.fixture(scope="module", params=QWEN3_5_VARIANTS)
def pair(request, qwen3_5_dirs):
    path = qwen3_5_dirs[request.param]
    return Labeler.from_pretrained(str(path), dtype="float32", device="cpu"), hf_model(path), path


def _mm_types(ids, cfg):
    return torch.tensor(
        [[1 if i == cfg.image_token_id else 2 if i == cfg.video_token_id else 0 for i in ids]]
    )


@pytest.mark.parametrize("case", CASES)
def test_pixels_positions_logits_and_greedy_tokens_match_transformers(pair, case):
    labeler, model, path = pair
    names, question = CASES[case]
    images = [photo(n) for n in names]
    processor = hf_processor(path)
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": question}]
    text = processor.apply_chat_template(
        [{"role": "user", "content": content}],
        tokenize=False,
        add_generation_prompt=True,
        enable_thinking=False,
    )
    ref = processor(text=[text], images=images or None, return_tensors="pt")
    req, _ = labeler.request("k", images, question, labeler.sampling(max_new_tokens=TOKENS))

    assert req.input_ids == ref["input_ids"][0].tolist()
    assert text.endswith("<think>\n\n</think>\n\n")  # thinking off by default
    if images:
        torch.testing.assert_close(
            torch.cat(req.pixel_values), ref["pixel_values"], atol=1e-6, rtol=0
        )
    positions, deltas = model.model.get_rope_index(
        ref["input_ids"],
        ref["mm_token_type_ids"],
        ref.get("image_grid_thw"),
        attention_mask=ref["attention_mask"],
    )
    assert torch.equal(req.rotary_position_ids, positions[:, 0]) and req.rope_delta == int(deltas)
    assert_logits_match(labeler, req, model, dict(ref))
    done = greedy(labeler, req)
    assert done.token_ids == reference_greedy(model, dict(ref)) and len(done.token_ids) == TOKENS


def test_a_video_matches_transformers(pair, tmp_path):
    labeler, model, path = pair
    clip = make_test_video(tmp_path / "clip.mp4", seconds=3, fps=8, width=160, height=96)
    prepared = labeler.requests.prepare([], [clip])
    req = labeler.requests.build("k", prepared, QUESTION, labeler.sampling(max_new_tokens=TOKENS))
    ids = reference_prompt_ids(path, ["video"], prepared.layout, QUESTION, enable_thinking=False)
    assert req.input_ids == ids
    grids = prepared.grids
    video_grid = torch.tensor([[len(grids), grids[0][1], grids[0][2]]])
    inputs = {
        "input_ids": torch.tensor([ids]),
        "pixel_values_videos": torch.cat(prepared.pixels),
        "video_grid_thw": video_grid,
        "mm_token_type_ids": _mm_types(ids, model.config),
    }
    positions, deltas = model.model.get_rope_index(
        inputs["input_ids"], inputs["mm_token_type_ids"], None, video_grid
    )
    assert torch.equal(req.rotary_position_ids, positions[:, 0]) and req.rope_delta == int(deltas)
    assert_logits_match(labeler, req, model, inputs)
    assert greedy(labeler, req).token_ids == reference_greedy(model, inputs)


def test_tasks_sharing_a_prefix_give_each_tasks_single_run(pair):
    """The linear layers' states are copied at the end of the shared prefix, as the KV rows
    are: each task's answer is the one it gets alone."""
    labeler, _, _ = pair
    items = [("cat", photo("chelsea.jpg")), ("cup", photo("coffee.jpg"))]
    tasks = labeler.tasks(["caption", "tags", "ocr"], max_new_tokens=12)
    together = {(r.key, r.task): r.token_ids for r in labeler.label(items, tasks=tasks)}
    assert labeler.runner.prefixes_prefilled >= 2  # the prefix really was shared
    for key, image in items:
        for task in tasks:
            (alone,) = labeler.label([(key, image)], tasks=[task])
            assert together[key, task.name] == alone.token_ids


def test_results_do_not_depend_on_the_batch(pair):
    labeler, _, path = pair
    names = ["chelsea.jpg", "astronaut.jpg", "coffee.jpg", "rocket.jpg"]
    items = [(n, photo(n)) for n in names]
    batched = {r.key: r.token_ids for r in labeler.label(items, max_new_tokens=12)}
    one = Labeler.from_pretrained(
        str(path), config=dataclasses.replace(labeler.config, engine=_one_seq(labeler.config))
    )
    for key, image in reversed(items):  # other slots, other order
        (alone,) = one.label([(key, image)], max_new_tokens=12)
        assert batched[key] == alone.token_ids


def _one_seq(config):
    return dataclasses.replace(config.engine, max_seqs=1)


def _token_by_token(q, k, v, decay, beta, start):
    steps, states, slots = [], start[None].clone(), torch.tensor([0])
    for t in range(q.shape[0]):
        token = (x[t : t + 1] for x in (q, k, v, decay, beta))
        steps.append(delta_rule.step(*token, states, slots)[0])
    return torch.stack(steps), states[0]


def test_chunked_delta_rule_is_the_token_by_token_recurrence():
    g = torch.Generator().manual_seed(0)
    length, key_heads, heads, dk, dv = 150, 2, 4, 16, 24  # three chunks, the last one partial
    q, k = (
        torch.randn(length, key_heads, dk, generator=g),
        torch.randn(length, key_heads, dk, generator=g),
    )
    v = torch.randn(length, heads, dv, generator=g)
    decay = -torch.rand(length, heads, generator=g)
    beta = torch.rand(length, heads, generator=g)
    start = torch.randn(heads, dk, dv, generator=g)
    out, state = delta_rule.chunked(q, k, v, decay, beta, start)
    steps, last = _token_by_token(q, k, v, decay, beta, start)
    torch.testing.assert_close(out, steps, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(state, last, atol=1e-4, rtol=1e-4)


def test_fast_decays_keep_subnormals_out_of_the_chunks_products():
    """Gates that decay fast take a chunk's far rows below float32's normal range: they are
    zero past delta_rule.DECAY_FLOOR, never subnormal (each product a subnormal enters costs a
    microcode assist on x86), and the chunked rule is still the recurrence."""
    g = torch.Generator().manual_seed(1)
    length, heads, d = 128, 4, 16  # two whole chunks
    q, k, v = (torch.randn(length, heads, d, generator=g) for _ in range(3))
    decay = -3 - 2 * torch.rand(length, heads, generator=g)  # to about e^-320 in a chunk
    beta = torch.rand(length, heads, generator=g)
    start = torch.randn(heads, d, d, generator=g)
    q4, k4, v4, g2, beta2 = delta_rule._prepare(q, k, v, decay, beta)
    chunks = length // delta_rule.CHUNK
    by_chunk = [x.reshape(heads, chunks, delta_rule.CHUNK, *x.shape[2:]) for x in (q4, k4, v4)]
    terms = delta_rule.chunk_terms(
        *by_chunk,
        g2.reshape(heads, chunks, delta_rule.CHUNK),
        beta2.reshape(heads, chunks, delta_rule.CHUNK),
    )
    tiny = torch.finfo(torch.float32).tiny
    for name, term in terms.items():
        magnitude = term.abs()
        assert not ((magnitude > 0) & (magnitude < tiny)).any(), name
    out, state = delta_rule.chunked(q, k, v, decay, beta, start)
    steps, last = _token_by_token(q, k, v, decay, beta, start)
    torch.testing.assert_close(out, steps, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(state, last, atol=1e-4, rtol=1e-4)


def test_a_padded_prompt_leaves_the_states_of_its_real_tokens(pair):
    """Compiled prefill pads a prompt to its bucket: the padding must not reach the conv or
    recurrent state the decode steps continue from."""
    labeler, _, _ = pair
    runner = labeler.runner
    req, _ = labeler.request("k", [], QUESTION, labeler.sampling(max_new_tokens=4))
    n = len(req.input_ids)
    item = PrefillItem(1, req.input_ids, req.rotary_position_ids, [], [], max_tokens=n + 8)
    runner._reserve([item])
    runner.forward_prompts([item])
    cache = runner.cache
    linear = [i for i, k in enumerate(cache.k) if k is None]
    expected = [(cache.conv[i][1].clone(), cache.recurrent[i][1].clone()) for i in linear]
    hidden = labeler.model.language_model.embed(torch.tensor(req.input_ids))
    pad = 64 - n
    rotary = torch.nn.functional.pad(req.rotary_position_ids, (0, pad))
    cos, sin = mrope_cos_sin(rotary, runner.inv_freq, runner.slot_axes)
    with torch.inference_mode():
        prefill_step(
            labeler.model,
            cache,
            torch.nn.functional.pad(hidden, (0, 0, 0, pad)),
            cos,
            sin,
            torch.tensor([2]),
            [],
            torch.tensor([n - 1]),
        )
    for i, (conv, recurrent) in zip(linear, expected):
        torch.testing.assert_close(cache.conv[i][2], conv, atol=1e-5, rtol=0)
        torch.testing.assert_close(cache.recurrent[i][2], recurrent, atol=1e-5, rtol=0)


def test_state_bytes_per_sequence_are_fixed_for_linear_layers(pair):
    labeler, _, _ = pair
    cache, cfg = labeler.runner.cache, labeler.model.cfg.text
    kv_short, fixed_short = cache.row_bytes(256)
    kv_long, fixed_long = cache.row_bytes(4096)
    assert fixed_short == fixed_long > 0 and kv_long == 16 * kv_short
    linear = sum(cfg.is_linear(i) for i in range(cfg.num_hidden_layers))
    recurrent = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim
    assert fixed_short == linear * (4 * recurrent + 4 * cfg.linear_conv_dim * 3)


def test_the_linear_states_are_sized_to_the_job(qwen3_5_dirs):
    """Rows for the sequences the job runs at once, not engine.max_seqs; their bytes do not grow
    with the context, the K/V columns do. A hybrid's rows each hold their recurrent states, which
    the scheduler's budget counts as the K/V columns of as many bytes (runner.row_columns)."""
    labeler = Labeler.from_pretrained(str(qwen3_5_dirs["qwen3_5"]), dtype="float32", device="cpu")
    runner, max_len = labeler.runner, labeler.config.engine.max_len
    cache = runner.cache
    assert cache.rows == 1 and labeler.config.engine.max_seqs == GROWN_SEQS
    kv, fixed = cache.row_bytes(max_len)
    assert (runner.row_columns - 1) * kv < fixed * max_len <= runner.row_columns * kv
    sampling = labeler.sampling(max_new_tokens=4)
    names = ["chelsea.jpg", "coffee.jpg", "rocket.jpg"]
    requests = [labeler.request(n, [photo(n)], QUESTION, sampling)[0] for n in names]
    assert len(list(labeler.engine.generate(requests))) == 3  # all three admitted at once
    linear = [i for i, k in enumerate(cache.k) if k is None]
    assert cache.rows == 3 and all(cache.recurrent[i].shape[0] == 3 for i in linear)
    assert all(cache.conv[i].shape[0] == 3 for i in linear)
    kv, fixed = cache.row_bytes(cache.columns)
    assert cache.nbytes == 3 * (kv + fixed)
