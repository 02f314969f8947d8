"""The scheduler on its own: slots, admission, groups, the prefill budget and stop rules (no
model)."""

import dataclasses

import pytest

from mmcli.config import EngineConfig, SamplingParams, engine_for, load_config
from mmcli.engine.scheduler import Scheduler
from mmcli.engine.sequence import Request


def request(key: str, tokens: int = 4, group: str | None = None, patches: int = 0, **sampling):
    grids = [(1, 2, patches // 2)] if patches else []
    return Request(
        key,
        list(range(tokens)),
        None,
        0,
        [],
        grids,
        SamplingParams(**sampling),
        frozenset({99}),
        group=group,
    )


def scheduler(
    max_seqs=2,
    max_len=64,
    budget=16384,
    lookahead=32,
    block_size=64,
    buckets=(1, 2),
    cache=0,
    row_columns=0,
):
    engine = {"max_seqs": max_seqs, "max_len": max_len, "max_prefill_tokens": budget}
    engine["max_cache_tokens"] = cache
    vision = {"block_size": block_size, "num_blocks_buckets": list(buckets), "lookahead": lookahead}
    cfg = load_config(None, {"engine": engine, "vision": vision, "image": {"max_pixels": 16384}})
    resolved = engine_for(cfg.engine, True, cfg.compile.decode_batch_buckets)
    return Scheduler(dataclasses.replace(cfg, engine=resolved), (0, 0), row_columns)


def test_admits_up_to_the_free_slots_in_order_and_frees_them_when_done():
    s = scheduler(max_seqs=2)
    for key in "abc":
        s.add(request(key))
    first = s.admit()
    assert [(q.request.key, q.slot) for q in first] == [("a", 0), ("b", 1)]
    assert s.admit() == [] and [r.key for r in s.waiting] == ["c"]
    s.append(first[1], 99, -0.1)  # b stops on its eos id
    assert [q.request.key for q in s.finish()] == ["b"] and first[1].finish_reason == "stop"
    assert [(q.request.key, q.slot) for q in s.admit()] == [("c", 1)]
    assert [q.request.key for q in s.decoding()] == ["a", "c"]


def test_length_limits_stop_a_sequence():
    s = scheduler(max_len=16)
    s.add(request("a", tokens=14, max_new_tokens=10))
    s.add(request("b", tokens=2, max_new_tokens=1))
    a, b = s.admit()
    s.append(a, 5, 0.0)
    s.append(b, 5, 0.0)
    assert a.finish_reason is None and b.finish_reason == "length"
    s.append(a, 5, 0.0)  # 14 prompt + 2 new tokens reach max_len 16
    assert a.finish_reason == "length"


def test_a_group_is_admitted_whole_or_waits_for_room():
    s = scheduler(max_seqs=3)
    s.add(request("x"))
    s.add(request("g1", group="g"))
    s.add(request("g2", group="g"))
    s.add(request("g3", group="g"))
    assert [q.request.key for q in s.admit()] == ["x"]  # the group of 3 waits: 2 slots left
    assert s.admit() == []
    (x,) = s.running
    s.append(x, 99, 0.0)
    s.finish()
    assert [q.request.key for q in s.admit()] == ["g1", "g2", "g3"]


def test_the_prefill_budget_holds_back_later_prompts_but_always_admits_one():
    s = scheduler(max_seqs=4, budget=10)
    for key, tokens in (("a", 8), ("b", 8), ("c", 1)):
        s.add(request(key, tokens=tokens))
    assert [q.request.key for q in s.admit()] == ["a"]
    assert [q.request.key for q in s.admit()] == ["b", "c"]


def test_a_vision_wave_is_chosen_for_least_padding():
    # Blocks of 64 patches, at most 2 blocks: the oldest goes, then the one that fills its block.
    s = scheduler(max_seqs=2, block_size=64)
    for key, patches in (("a", 40), ("b", 40), ("c", 24)):
        s.add(request(key, patches=patches))
    assert [q.request.key for q in s.admit()] == ["a", "c"]


def test_the_kv_cache_budget_holds_back_long_prompts_but_always_admits_one():
    # 4 rows of 256 columns: short prompts 4 at a time; a long one alone, and as the cache never
    # shrinks, the rows after it wait until it is done
    s = scheduler(max_seqs=4, max_len=1024, cache=1024)
    for key, tokens in (("a", 10), ("b", 10), ("long", 600), ("c", 10)):
        s.add(request(key, tokens=tokens, max_new_tokens=10))
    assert [q.request.key for q in s.admit()] == ["a", "b"] and s.cache_shape == (2, 256)
    for seq in s.running:
        s.append(seq, 99, 0.0)
    s.finish()
    assert [q.request.key for q in s.admit()] == ["long"] and s.cache_shape == (2, 768)
    assert s.admit() == []  # c's row would take the cache past 1024 tokens
    s.append(s.running[0], 99, 0.0)
    s.finish()
    assert [(q.request.key, q.slot) for q in s.admit()] == [("c", 0)]


def test_a_rows_fixed_state_counts_in_the_cache_budget():
    """A hybrid decoder's rows each hold their linear layers' states whatever their length: 256
    columns' worth here. Two rows of max_len (2 x (1024 + 256)) is the budget; short prompts (256
    columns) take 512 a row: 5 of them, where the K/V columns alone would admit 8."""
    s = scheduler(max_seqs=8, max_len=1024, cache=2048, row_columns=256)
    for n in range(8):
        s.add(request(f"r{n}", tokens=10, max_new_tokens=10))
    assert len(s.admit()) == 5 and s.cache_shape == (5, 256)
    alone = scheduler(max_seqs=8, max_len=1024, cache=2048)
    for n in range(8):
        alone.add(request(f"r{n}", tokens=10, max_new_tokens=10))
    assert len(alone.admit()) == 8


def test_the_engine_limits_are_the_runs():
    """0s resolved by the run: 32 sequences where the KV cache grows to the job, as much cache as 8
    of max_len; a compiled run's largest decode bucket; what is set, kept."""
    auto = EngineConfig(max_len=4096)
    assert engine_for(auto, True, (1, 2, 4, 8)) == EngineConfig(32, 4096, 16384, 8 * 4096)
    assert engine_for(auto, False, (1, 2, 4, 8)) == EngineConfig(8, 4096, 16384, 8 * 4096)
    set_ = EngineConfig(max_seqs=3, max_len=512, max_cache_tokens=4096)
    assert engine_for(set_, True, (1, 2, 4, 8)) == set_
    assert engine_for(EngineConfig(max_seqs=3), True, (1,)).max_cache_tokens == 3 * 4096
    with pytest.raises(ValueError, match="run's engine settings"):
        Scheduler(load_config())
