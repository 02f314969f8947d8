"""The batched engine and the packed vision path, on a tiny checkpoint."""

import time
from dataclasses import replace

import pytest
import torch
from conftest import SAMPLES, photo

import mmcli.api.labeler as labeler_module
from mmcli.api.labeler import Labeler
from mmcli.config import GROWN_SEQS, load_config
from mmcli.engine.packing import ffd_pack
from mmcli.engine.vision_encoder import VisionEncoder
from mmcli.inputs.prefetch import NOT_READY

SIZES = [
    (224, 224),
    (97, 211),
    (640, 480),
    (128, 128),
    (300, 77),
    (512, 384),
    (64, 500),
    (451, 300),
]
NAMES = ["astronaut.jpg", "chelsea.jpg", "coffee.jpg", "rocket.jpg"]


def _items(tmp_path):
    items = []
    for n, size in enumerate(SIZES):
        f = tmp_path / f"img{n}.png"
        photo(NAMES[n % 4], size).save(f)
        items.append((f"img{n}", f))
    return items


def _waiting_for_each(prefetch):
    """`prefetch` that waits for the next input where it would say none is ready yet."""

    def waiting(*args):
        for ready in prefetch(*args):
            if ready is NOT_READY:
                time.sleep(0.002)
                continue
            yield ready

    return waiting


def _labeler(path, **config):
    overrides = {"dtype": "float32", "device": "cpu", **config}
    return Labeler.from_pretrained(str(path), config=load_config(None, overrides))


def test_packed_vision_equals_per_image_path(tiny_dir):
    cap = _labeler(tiny_dir)
    # 7 images of different sizes; the 8x8-patch one (64 patches) fills a 64-patch block exactly
    images = [
        photo(NAMES[i % 4], s)
        for i, s in enumerate(
            [(256, 256), (97, 211), (128, 64), (300, 77), (64, 64), (200, 150), (40, 400)]
        )
    ]
    reqs = [cap.request(f"k{i}", [im], "q", cap.sampling())[0] for i, im in enumerate(images)]
    pixels = [r.pixel_values[0] for r in reqs]
    grids = [r.vision_grids[0] for r in reqs]
    assert 64 in [t * h * w for t, h, w in grids]
    reference = _per_image(cap, pixels, grids)
    # (64, (1, 2)) needs more blocks than its largest bucket: the wave is split into several calls;
    # eager, a row per block or (attention by range) the blocks end to end in one row
    for block_size, buckets, fixed, one_row in (
        (64, (1, 2, 4, 8), True, False),
        (64, (1, 2), True, False),
        (128, (4, 8), True, False),
        (256, (2,), True, False),
        (1024, (1,), False, False),
        (128, (4, 8), False, False),
        (128, (4, 8), False, True),
        (64, (1, 2), False, True),
    ):
        packed = VisionEncoder(
            cap.model.visual, cap.runner.device, block_size, buckets, fixed, one_row=one_row
        ).encode(pixels, grids)
        for (f_ref, ds_ref), (f, ds) in zip(reference, packed):
            torch.testing.assert_close(f, f_ref, atol=1e-5, rtol=0)
            for a, b in zip(ds, ds_ref):
                torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    assert len(reference) == len(images)


def test_eager_vision_lays_its_blocks_end_to_end_without_padding(tiny_dir):
    """Where the tower's attention works range by range (eager on the CPU) a call computes no
    padding rows: a wave of several blocks of unequal fill is one row as long as its patches,
    each image's rows bounded to its own. Fixed shapes keep the blocks and the bucket, other
    eager attention (masked: its cost the row's square) a row per block."""
    cap = _labeler(tiny_dir)
    images = [photo(NAMES[i % 4], s) for i, s in enumerate([(256, 256), (128, 64), (64, 64)])]
    reqs = [cap.request(f"k{i}", [im], "q", cap.sampling())[0] for i, im in enumerate(images)]
    pixels, grids = [r.pixel_values[0] for r in reqs], [r.vision_grids[0] for r in reqs]
    patches = [t * h * w for t, h, w in grids]
    block = max(patches)
    bins = ffd_pack(patches, block)
    assert len({sum(patches[i] for i in b) for b in bins}) > 1  # a row per block would pad
    assert cap.runner.encoder.one_row  # the CPU's eager attention works range by range
    eager = VisionEncoder(cap.model.visual, cap.runner.device, block, (4,), False, one_row=True)
    inputs, _ = eager.packed_inputs(pixels, grids, bins)
    assert tuple(inputs["pixels"].shape[:2]) == (1, sum(patches))
    bounds = list(zip(inputs["bound_min"][0].tolist(), inputs["bound_max"][0].tolist()))
    start = 0
    for n in patches:  # in image order
        assert bounds[start : start + n] == [(start, start + n)] * n
        start += n
    for fixed, shape in ((True, (4, block)), (False, (len(bins), block))):
        encoder = VisionEncoder(cap.model.visual, cap.runner.device, block, (4,), fixed)
        assert tuple(encoder.packed_inputs(pixels, grids, bins)[0]["pixels"].shape[:2]) == shape


def _per_image(cap, pixels, grids):
    return VisionEncoder(cap.model.visual, cap.runner.device, None, (1,), False).encode(
        pixels, grids
    )


def test_caption_tokens_do_not_depend_on_block_size_or_bucket(tiny_dir, tmp_path):
    items = _items(tmp_path)[:5]
    runs = []
    for vision in (
        {"block_size": 64, "num_blocks_buckets": [1, 2, 4, 8]},
        {"block_size": 1024, "num_blocks_buckets": [4]},
    ):
        cap = _labeler(
            tiny_dir,
            vision=vision,
            generation={"max_new_tokens": 8},
            image={"max_pixels": 128 * 128},
        )
        cap.runner.encoder.fixed_shapes = True
        runs.append({r.key: r.token_ids for r in cap.label(items)})
    assert runs[0] == runs[1] and len(runs[0]) == 5


def test_greedy_tokens_same_alone_or_among_eight_with_three_in_flight(tiny_dir, tmp_path):
    items = _items(tmp_path)
    alone_cap = _labeler(tiny_dir, engine={"max_seqs": 1}, generation={"max_new_tokens": 12})
    alone = {key: next(iter(alone_cap.label([(key, path)]))).token_ids for key, path in items}
    batched_cap = _labeler(tiny_dir, engine={"max_seqs": 3}, generation={"max_new_tokens": 12})
    batched = {r.key: r.token_ids for r in batched_cap.label(items)}
    assert batched == alone and len(alone) == 8


def test_sampled_output_does_not_depend_on_order(tiny_dir, tmp_path):
    items = _items(tmp_path)
    cap = _labeler(tiny_dir, engine={"max_seqs": 3})
    kw = {"temperature": 1.0, "top_p": 0.9, "top_k": 50, "max_new_tokens": 10, "seed": 7}
    first = {r.key: r.token_ids for r in cap.label(items, **kw)}
    second = {r.key: r.token_ids for r in cap.label(list(reversed(items)), **kw)}
    assert first == second
    other_seed = {r.key: r.token_ids for r in cap.label(items, **{**kw, "seed": 8})}
    assert other_seed != first


def test_results_come_as_they_finish_and_bad_files_are_error_results(tiny_dir, tmp_path):
    items = _items(tmp_path)[:3]
    bad = tmp_path / "bad.jpg"
    bad.write_bytes(b"not an image")
    cap = _labeler(tiny_dir, engine={"max_seqs": 2})
    results = list(cap.label(items[:1] + [("bad", bad)] + items[1:], max_new_tokens=4))
    assert sorted(r.key for r in results) == ["bad", "img0", "img1", "img2"]
    bad_result = next(r for r in results if r.key == "bad")
    assert not bad_result.ok and "not an image" in bad_result.error["message"]
    assert replace(bad_result, error=None).ok and SAMPLES.is_dir()


def test_an_image_seen_twice_in_a_run_is_encoded_once(tiny_dir, tmp_path):
    items = _items(tmp_path)[:3]
    twice = items + [("again", items[1][1]), ("third", items[0][1])]
    cap = _labeler(tiny_dir, engine={"max_seqs": 2})
    results = {r.key: r.token_ids for r in cap.label(twice, max_new_tokens=5)}
    assert cap.runner.images_encoded == 3
    assert results["again"] == results["img1"] and results["third"] == results["img0"]


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")
def test_packed_linear_equals_the_plain_product_and_frees_the_plain_weight():
    from mmcli.models.layers.linear import Linear
    from mmcli.weights.loader import pack_linears

    torch.manual_seed(0)
    embed = torch.nn.Embedding(300, 64)
    model = torch.nn.ModuleDict(
        {
            "a": Linear(64, 96, bias=True),
            "b": Linear(96, 64, bias=False),
            "head": Linear(64, 300, bias=False),
            "embed": embed,
        }
    ).requires_grad_(False)
    model["head"].weight = embed.weight  # tied: the embedding keeps the plain weight
    plain = {name: (m.weight.clone(), m.bias) for name, m in model.items() if isinstance(m, Linear)}
    assert pack_linears(model) == 3
    assert all(getattr(model[name], "weight", None) is None for name in plain)
    assert embed.weight.shape == (300, 64)
    with torch.inference_mode():
        for rows in (0, 1, 3, 16, 40):
            for name, (weight, bias) in plain.items():
                x = torch.randn(rows, weight.shape[1])
                torch.testing.assert_close(
                    model[name](x), torch.nn.functional.linear(x, weight, bias), atol=1e-5, rtol=0
                )
        x = torch.randn(2, 5, 64)[:, ::2]  # 3-D and not contiguous
        torch.testing.assert_close(
            model["a"](x), torch.nn.functional.linear(x, *plain["a"]), atol=1e-5, rtol=0
        )
    assert pack_linears(model) == 0  # already packed


def test_the_kv_cache_budget_holds_across_jobs(tiny_dir, tmp_path, monkeypatch):
    """A long sequence widens the KV cache, which never shrinks: the next job's sequences then
    run one at a time within engine.max_cache_tokens (one row of 512 columns here), where all
    three run at once with room; the tokens are the same."""
    # each input waited for: on a busy machine the engine would otherwise start on those ready
    # and grow the cache to fewer rows
    monkeypatch.setattr(labeler_module, "prefetch", _waiting_for_each(labeler_module.prefetch))
    items = _items(tmp_path)[:3]
    cap = _labeler(tiny_dir, engine={"max_len": 512, "max_cache_tokens": 512})
    assert cap.config.engine.max_seqs == GROWN_SEQS  # the CPU's: the cache grows to the job
    list(cap.label(items[:1], max_new_tokens=300))
    assert cap.runner.cache_shape == (1, 512)
    narrow = {r.key: r.token_ids for r in cap.label(items, max_new_tokens=4)}
    assert cap.runner.cache_shape == (1, 512)
    roomy = _labeler(tiny_dir, engine={"max_len": 512})
    assert {r.key: r.token_ids for r in roomy.label(items, max_new_tokens=4)} == narrow
    assert roomy.runner.cache_shape == (3, 256)
