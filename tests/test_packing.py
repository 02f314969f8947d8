import collections
import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mmcli.compiled.buckets import choose_bucket
from mmcli.config import load_config
from mmcli.engine.packing import (
    block_bounds,
    choose_wave,
    ffd_pack,
    flat_efficiency,
    gather_index,
    make_layout,
    packed_efficiency,
    padded_efficiency,
    unpack_index,
)
from mmcli.errors import ConfigError

token_lists = st.lists(st.integers(1, 64).map(lambda n: 4 * n), min_size=1, max_size=9)


def pack(tokens, block_size, buckets):
    """FFD bins laid out in the smallest bucket that holds them (what a vision call does)."""
    bins = ffd_pack(tokens, block_size)
    return make_layout(tokens, bins, choose_bucket(len(bins), buckets), block_size)


def optimal_bins(tokens, block_size):
    """Exact bin-packing optimum by trying every assignment (small lists only)."""
    for k in range(1, len(tokens) + 1):
        for assignment in itertools.product(range(k), repeat=len(tokens) - 1):
            loads = [0] * k
            for t, b in zip(tokens, (0,) + assignment):
                loads[b] += t
            if max(loads) <= block_size:
                return k
    return len(tokens)


@settings(max_examples=150, deadline=None)
@given(token_lists, st.sampled_from([256, 260, 512]))
def test_ffd_places_every_image_once_within_capacity_and_near_optimal(tokens, block_size):
    bins = ffd_pack(tokens, block_size)
    assert sorted(i for b in bins for i in b) == list(range(len(tokens)))
    assert all(sum(tokens[i] for i in b) <= block_size for b in bins)
    if len(tokens) <= 7:
        assert len(bins) <= 11 / 9 * optimal_bins(tokens, block_size) + 1


@settings(max_examples=150, deadline=None)
@given(token_lists, st.integers(1, 3))
def test_bounds_confine_queries_and_unpack_inverts_pack(tokens, temporal):
    block_size = 512
    frames = [[t] * 1 for t in tokens]
    if temporal > 1:  # some images made of several temporal patches of equal size
        frames = [[t // 4] * 4 if t % 16 == 0 else [t] for t in tokens]
    layout = pack(tokens, block_size, [1, 2, 4, 8, 16])
    index = gather_index(tokens, layout)
    bmin, bmax = block_bounds(frames, layout)
    owner = []  # (image, frame) of each flat row
    for i, fr in enumerate(frames):
        for f, n in enumerate(fr):
            owner += [(i, f)] * n
    rows_of = collections.Counter(owner)
    for row, src in enumerate(index):
        if src < 0:
            assert bmin[row] == bmax[row] == 0
            continue
        base = row - row % block_size
        seen = {owner[index[base + k]] for k in range(bmin[row], bmax[row])}
        assert seen == {owner[src]}  # every key a query sees is its own image's own temporal patch
        assert rows_of[owner[src]] == bmax[row] - bmin[row]
    x = torch.randn(sum(tokens), 3)
    packed = torch.zeros(len(index), 3)
    real = torch.tensor(index) >= 0
    packed[real] = x[torch.tensor(index)[real]]
    assert torch.equal(packed[torch.tensor(unpack_index(tokens, layout, 1))], x)
    merged = packed.view(-1, 4, 3).sum(1)  # a stand-in for the 2x2 merger
    assert torch.equal(
        merged[torch.tensor(unpack_index(tokens, layout, 4))], x.view(-1, 4, 3).sum(1)
    )


def test_bucket_choice_and_overflow():
    assert choose_bucket(3, [1, 2, 4, 8]) == 4 and choose_bucket(1, [8, 2]) == 2
    with pytest.raises(ValueError, match="over the largest bucket"):
        choose_bucket(9, [1, 2, 4, 8])
    with pytest.raises(ValueError, match="over block_size"):
        ffd_pack([300], 256)
    assert make_layout([4, 4], [[0, 1]], 2, 8).bins == ((0, 1), ())


def test_seed_004_worked_example():
    tokens = [1024, 512, 256, 128, 128]
    layout = pack(tokens, 1024, [1, 2, 4])
    assert layout.num_blocks == 2
    assert round(100 * packed_efficiency(tokens, 2, 1024), 1) == 67.2
    assert round(100 * flat_efficiency(tokens), 1) == 33.6
    assert round(100 * padded_efficiency(tokens), 1) == 26.9
    thumbs = [128] * 24
    assert round(100 * flat_efficiency(thumbs), 1) == 4.2
    assert packed_efficiency(thumbs, len(ffd_pack(thumbs, 1024)), 1024) == 0.125
    assert packed_efficiency(thumbs, len(ffd_pack(thumbs, 256)), 256) == 0.5


def test_wave_fills_its_bucket_better_than_arrival_order():
    # patches of each waiting request
    waiting = [
        [400],
        [400],
        [400],
        [100],
        [100],
        [100],
        [100],
        [100],
    ]
    wave = choose_wave(waiting, 3, 512, [1, 2, 4])
    arrival = [0, 1, 2]
    assert wave[0] == 0 and len(wave) == 3
    fill = lambda ids: sum(waiting[i][0] for i in ids)  # noqa: E731

    # noqa: E731
    def used(ids):
        return choose_bucket(len(ffd_pack([waiting[i][0] for i in ids], 512)), [1, 2, 4])

    assert used(wave) <= used(arrival)
    assert fill(wave) / (used(wave) * 512) > fill(arrival) / (used(arrival) * 512) or used(
        wave
    ) < used(arrival)


def test_config_whose_pixel_budget_does_not_fit_its_block_is_refused(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("vision:\n  block_size: 1024\nimage:\n  max_pixels: 1310720\n")
    with pytest.raises(ConfigError) as e:
        load_config(f)
    assert str(e.value) == (
        "config image.max_pixels 1310720 allows images of 5120 patches, over vision.block_size "
        "1024: set image.max_pixels <= 262144 or vision.block_size >= 5120"
    )
    f.write_text("vision:\n  block_size: 1022\n")
    with pytest.raises(ConfigError, match="multiple of merge_size"):
        load_config(f)


def _plan(*args):
    from typer.testing import CliRunner

    from mmcli.cli.app import app

    result = CliRunner().invoke(app, ["plan", *args], terminal_width=200)
    assert result.exit_code == 0, result.output
    return result.output


def test_plan_shows_the_seed_004_example():
    out = _plan("--tokens", "1024,512,256,128,128", "--block-size", "1024")
    assert "5 images in 2 blocks of 1024 patches" in out
    assert "blocks of 1024: 67.2%" in out and "mask: 33.6%" in out and "largest: 26.9%" in out


def test_plan_thumbnails_and_recommendation():
    from mmcli.engine.packing import recommend_block_size, vision_work

    thumbs = ",".join(["128"] * 24)
    assert "mask: 4.2%" in _plan("--tokens", thumbs, "--block-size", "1024")
    assert "blocks of 1024: 12.5%" in _plan("--tokens", thumbs, "--block-size", "1024")
    assert "blocks of 256: 50.0%" in _plan("--tokens", thumbs, "--block-size", "256")
    mixed = [1024, 512, 256, 128, 128, 300, 64, 700]
    best = recommend_block_size(mixed)
    candidates = range(1024, 3200, 128)
    assert best >= max(mixed) and all(
        vision_work(mixed, best) <= vision_work(mixed, c) for c in candidates
    )
    out = _plan("--tokens", ",".join(map(str, mixed)))
    assert f"recommended block_size: {best} " in out
    assert "eager on the CPU: 1 call(s) of up to 8 blocks" in out  # vision.num_blocks_buckets
    # 9 images of 1024 patches a block at 1024: a call of 8 blocks, then one of the ninth
    many = _plan("--tokens", ",".join(["1024"] * 9), "--block-size", "1024")
    assert "2 call(s) of up to 8 blocks, each one row of its blocks end to end" in many
    assert "8192 patches at most" in many


def test_plan_on_a_folder(tmp_path):
    from PIL import Image

    for n, size in enumerate([(640, 480), (224, 224), (300, 200)]):
        Image.new("RGB", size).save(tmp_path / f"{n}.png")
    out = _plan(str(tmp_path), "--block-size", "1280")
    # smart_resize: 640x480 -> 30x40 patches; 224x224 and 300x200 are raised to min_pixels: 16x16
    # and 14x20
    assert "3 images in 2 blocks of 1280 patches" in out
    assert "0.png (1200)" in out and "1.png (256)" in out and "2.png (280)" in out


def test_segment_attention_equals_the_bounded_reference():
    from mmcli.kernels.attention import bounded_attention, segment_attention

    tokens = [40, 24, 8, 16, 12]
    layout = pack(tokens, 64, [2, 4])
    bmin, bmax = block_bounds([[t] for t in tokens], layout)
    shape = (layout.num_blocks, 64)
    bound_min, bound_max = torch.tensor(bmin).view(shape), torch.tensor(bmax).view(shape)
    q, k, v = (torch.randn(layout.num_blocks, 2, 64, 8) for _ in range(3))
    reference = bounded_attention(q, k, v, bound_min, bound_max)
    torch.testing.assert_close(
        segment_attention(q, k, v, bound_min, bound_max), reference, atol=1e-6, rtol=1e-6
    )
    padding = bound_max <= bound_min
    assert padding.any() and reference.transpose(1, 2)[padding].abs().max() == 0
