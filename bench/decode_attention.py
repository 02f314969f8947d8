"""A decode step's attention over its KV cache against the read floor of that cache, in one
process: the step at R sequences and C cache columns less the same step at its first column,
beside a stream of exactly the cache bytes those sequences' attention reads (both cores), the
two timed in turns (the best of 5). The ratio is comparable across runs and trees: each is held
to the bandwidth its own process saw.

python bench/decode_attention.py [--smoke] [--settings '{"quantize": "int8"}']
    [--rows 1,8,32] [--columns 300,1000]
python bench/decode_attention.py --pages [--smoke] [--rows 8,32] [--columns 300,1000]
    (decode_layer.c's attention alone over every layer's cache held in 4 KiB pages and in
    2 MiB ones, as the cache holds it, in turns, float32 and bfloat16)

Run with PYTHONPATH=<a git worktree> for another tree's mmcli."""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import tempfile
from pathlib import Path

import compare_hf
import torch
from cpu import best_seconds

from mmcli.api.labeler import Labeler
from mmcli.config import load_config
from mmcli.engine.batch import DecodeItem
from mmcli.kernels import cpu
from mmcli.kernels.host_memory import zeros_in_huge_pages
from mmcli.weights.checkpoint import read_model_config


def cache_stream(cache, rows: int, columns: int):
    """A function that reads the K and V columns the first `rows` cache rows attend over
    (every full-attention layer), and their bytes."""
    parts = [s[:rows, :, :columns] for s in (*cache.k, *cache.v) if s is not None]
    # a bfloat16 cache read as 32-bit words: torch's bfloat16 amax is not at the memory's rate
    words = [p.view(torch.int32) if p.element_size() == 2 else p for p in parts]
    return (lambda: [w.amax() for w in words]), sum(p.numel() * p.element_size() for p in parts)


def attention_rates(ckpt: Path, settings: dict, rows: list[int], columns: list[int]) -> list:
    """(rows, columns, attention seconds, KV bytes, stream seconds) for each pair."""
    engine = {"max_seqs": max(rows), "max_len": max(columns) + 1}
    cfg = load_config(None, {"device": "cpu", "engine": engine, **settings})
    cap = Labeler.from_pretrained(str(ckpt), config=cfg)
    runner = cap.runner
    runner.cache.grow(max(rows) + 1, max(columns) + 1)
    results = []
    for n in rows:
        first = [DecodeItem(i, 100 + i, 0, 0) for i in range(n)]
        for c in columns:
            items = [DecodeItem(i, 100 + i, c, 0) for i in range(n)]
            stream, kv_bytes = cache_stream(runner.cache, n, c + 1)
            with torch.inference_mode():
                step, first_column, streamed = best_seconds(
                    lambda items=items: runner.decode(items),
                    lambda first=first: runner.decode(first),
                    stream,
                )
            results.append((n, c, step - first_column, kv_bytes, streamed))
    return results


def filled_caches(layers: int, shape: tuple, dtype: torch.dtype, huge: bool) -> list:
    """`layers` pairs of random K and V caches, in 2 MiB pages (huge) or torch's own."""

    def one() -> torch.Tensor:
        cache = zeros_in_huge_pages(shape, dtype) if huge else torch.zeros(shape, dtype=dtype)
        return cache.copy_(torch.randn(shape))

    return [(one(), one()) for _ in range(layers)]


def attend_over(caches: list, q, k, v, slots, positions) -> None:
    """decode_layer.c's attention of q (writing k and v) over each layer's (K, V) in turn."""
    for k_cache, v_cache in caches:
        cpu.decode_attention(q, k, v, k_cache, v_cache, slots, positions)


def page_case(layers: int, heads: int, shape: tuple, dtype: torch.dtype) -> tuple:
    """(KV bytes, seconds in 4 KiB pages, in 2 MiB pages) of the attention of shape's rows at
    their last column over `layers` caches of `shape` (rows, kv_heads, columns, d)."""
    n, kv_heads, c, d = shape
    small, huge = (filled_caches(layers, shape, dtype, h) for h in (False, True))
    inputs = (torch.randn(n, heads, d), *torch.randn(2, n, kv_heads, d))
    inputs += (torch.arange(n), torch.full((n,), c - 1))
    in_small, in_huge = best_seconds(
        functools.partial(attend_over, small, *inputs),
        functools.partial(attend_over, huge, *inputs),
    )
    return 2 * layers * small[0][0].numel() * small[0][0].element_size(), in_small, in_huge


def page_rates(ckpt: Path, rows: list[int], columns: list[int]) -> list:
    """(dtype, rows, columns, KV bytes, seconds in 4 KiB pages, in 2 MiB pages): decode_layer.c's
    attention alone over every full-attention layer's cache, every row at its last column."""
    text = read_model_config(ckpt).text
    layers = sum(not text.is_linear(i) for i in range(text.num_hidden_layers))
    results = []
    for dtype, n, c in itertools.product((torch.float32, torch.bfloat16), rows, columns):
        shape = (n, text.num_key_value_heads, c, text.head_dim)
        results.append((dtype, n, c, *page_case(layers, text.num_attention_heads, shape, dtype)))
    return results


def add_step_arguments(parser: argparse.ArgumentParser) -> None:
    """The decode steps a bench times: the checkpoint, the settings, the rows and columns."""
    parser.add_argument("--smoke", action="store_true", help="the tiny checkpoint")
    parser.add_argument("--settings", default="{}", help="config overrides, JSON")
    parser.add_argument("--rows", default="1,8,32")
    parser.add_argument("--columns", default="300,1000")
    parser.add_argument("--cache-dir", type=Path, default=None)


def step_inputs(args) -> tuple[Path, dict, list[int], list[int]]:
    """add_step_arguments' checkpoint (written once, as compare_hf's), settings, rows and
    columns."""
    if args.cache_dir is None:
        smoke_dir = Path(tempfile.gettempdir()) / "mmcli-bench"
        args.cache_dir = smoke_dir if args.smoke else compare_hf.ROOT / ".bench_cache"
    ckpt, _, _ = compare_hf.make_inputs(args.cache_dir, args.smoke)
    rows = [int(r) for r in args.rows.split(",")]
    columns = [int(c) for c in args.columns.split(",")]
    return ckpt, json.loads(args.settings), rows, columns


def print_pages(results: list) -> None:
    print("cache | rows | columns | KV read | 4 KiB pages ms | 2 MiB pages ms | 4 KiB / 2 MiB")
    for dtype, n, c, kv_bytes, in_small, in_huge in results:
        name = str(dtype).removeprefix("torch.")
        print(
            f"{name} | {n} | {c} | {kv_bytes / 1e9:.2f} GB | {in_small * 1e3:.1f} | "
            f"{in_huge * 1e3:.1f} | {in_small / in_huge:.2f}x"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_step_arguments(parser)
    parser.add_argument("--pages", action="store_true", help="4 KiB against 2 MiB pages")
    args = parser.parse_args()
    ckpt, settings, rows, columns = step_inputs(args)
    print(f"{ckpt.name}, settings {settings}, {torch.get_num_threads()} threads")
    if args.pages:
        print_pages(page_rates(ckpt, rows, columns))
        return
    print("rows | columns | attention ms | KV read | its stream GB/s | attention / stream")
    for n, c, seconds, kv_bytes, streamed in attention_rates(ckpt, settings, rows, columns):
        print(
            f"{n} | {c} | {seconds * 1e3:.1f} | {kv_bytes / 1e9:.2f} GB | "
            f"{kv_bytes / streamed / 1e9:.1f} | {seconds / streamed:.2f}x"
        )


if __name__ == "__main__":
    main()
