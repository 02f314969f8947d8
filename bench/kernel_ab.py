"""This tree's C kernels against another commit's, in one process: the same model, weights and
KV cache, the decode step run with each library in turns (the best of --repeats), so that
neither the host's placement of the pages nor a neighbour's load falls on one side only. The
Python side (the weights' layout, the scratch) is this tree's: it compares kernels whose
interface did not change, and the commit's C structs and declarations (kernels/cpu.py) must be
this tree's.

python bench/kernel_ab.py --against COMMIT [--smoke] [--settings '{"quantize": "int8"}']
    [--rows 1,8,32] [--columns 300,1000]
python bench/kernel_ab.py --against COMMIT --attention [--smoke]   (attention.c alone)
python bench/kernel_ab.py --against COMMIT --cache-attention [--rows 8,32] [--columns 300,1000]
    (decode_layer.c's attention over a step's cache alone, float32 and bfloat16 caches)"""

from __future__ import annotations

import argparse
import ctypes
import functools
import itertools
import re
import subprocess
import tempfile
import time
from pathlib import Path

import compare_hf
import torch
from decode_attention import add_step_arguments, attend_over, filled_caches, step_inputs
from float_kernels import (
    ATTENTION,
    SMOKE_ATTENTION,
    attention_inputs,
    attention_shape,
    bf16_attention_products,
)

from mmcli.api.labeler import Labeler
from mmcli.config import load_config
from mmcli.engine.batch import DecodeItem
from mmcli.kernels import cpu
from mmcli.weights.checkpoint import read_model_config

# kernels/cpu.py's C structs and declarations
INTERFACE = [
    re.compile(r"^class DecodeMatrix.*?^@functools.cache", re.S | re.M),
    re.compile(r"^def _declare.*?^def eager", re.S | re.M),
]


def git_show(commit: str, path: str) -> bytes:
    command = ["git", "-C", str(compare_hf.ROOT), "show", f"{commit}:{path}"]
    return subprocess.run(command, check=True, capture_output=True).stdout


def commit_library(commit: str, into: Path) -> ctypes.CDLL:
    """The commit's kernels built as this machine's build of ours is (its flags, its sources by
    name), declared as ours."""
    ours = Path(cpu.__file__).read_text()
    theirs = git_show(commit, "mmcli/kernels/cpu.py").decode()
    if any(part.search(theirs)[0] != part.search(ours)[0] for part in INTERFACE):
        raise SystemExit(f"{commit}'s C declarations differ from this tree's: not comparable")
    library, reason = cpu.load()
    if library is None:
        raise SystemExit(f"the kernels do not build here: {reason}")
    files = [into / f.name for f in [*library.sources, *cpu.HEADERS]]
    for file in files:
        file.write_bytes(git_show(commit, f"mmcli/kernels/csrc/{file.name}"))
    sources, headers = files[: len(library.sources)], files[len(library.sources) :]
    torch_lib = Path(torch.__file__).parent / "lib"
    path = cpu._build(cpu.compiler(), torch_lib, library.flags, sources, headers)
    theirs_library = ctypes.CDLL(str(path))
    theirs_library.build, theirs_library.int4_vnni = library.build, library.int4_vnni
    theirs_library.int4_widened = library.int4_widened
    cpu._declare(theirs_library)
    return theirs_library


def in_turns(libraries: dict, calls: dict, repeats: int) -> dict:
    """{(key, side): the best seconds of calls[key] with that side's library loaded}, after a
    warm-up round, the sides taking turns on each call."""
    load, best = cpu.load, {}
    try:
        for attempt in range(repeats + 1):  # the first a warm-up
            for key, call in calls.items():
                for side, library in libraries.items():
                    cpu.load = lambda library=library: (library, "")
                    start = time.perf_counter()
                    call()
                    seconds = time.perf_counter() - start
                    if attempt:
                        best[key, side] = min(best.get((key, side), seconds), seconds)
    finally:
        cpu.load = load
    return best


def steps(ckpt: Path, settings: dict, libraries: dict, rows: list, columns: list, repeats: int):
    """{((rows, columns), side): the best decode step's seconds}, the sides taking turns."""
    engine = {"max_seqs": max(rows), "max_len": max(columns) + 1}
    cfg = load_config(None, {"device": "cpu", "engine": engine, **settings})
    runner = Labeler.from_pretrained(str(ckpt), config=cfg).runner
    runner.cache.grow(max(rows) + 1, max(columns) + 1)
    calls = {
        (n, c): functools.partial(runner.decode, [DecodeItem(i, 100 + i, c, 0) for i in range(n)])
        for n in rows
        for c in columns
    }
    with torch.inference_mode():
        return in_turns(libraries, calls, repeats)


def attention(libraries: dict, shapes: list, repeats: int) -> dict:
    """{(shape, side): attention.c's best seconds on float_kernels' shape}, on this build's
    best products (the tiles, AVX-512 BF16's pairs, else float32), the sides taking turns on
    one shape at a time (shapes in turns left the first side its inputs out of L2: 0.67x on
    the same code)."""
    products = (bf16_attention_products() or ["float32"])[-1]
    best = {}
    for shape in shapes:
        q, k, v = attention_inputs(*shape[:4])
        call = functools.partial(cpu.attention, q, k, v, shape[4], products)
        best.update(in_turns(libraries, {shape: call}, repeats))
    return best


CACHE_LAYERS = 8  # the layers' caches timed (the 2B's step reads 28)


def cache_heads(ckpt: Path) -> tuple[int, int, int]:
    """The checkpoint's query heads, key/value heads and head size."""
    text = read_model_config(ckpt).text
    return text.num_attention_heads, text.num_key_value_heads, text.head_dim


def cache_attention(
    libraries: dict, heads: tuple[int, int, int], rows: list, columns: list, repeats: int
) -> dict:
    """{((rows, columns, cache dtype), side): decode_layer.c's attention alone over CACHE_LAYERS
    layers' caches of that dtype in 2 MiB pages, as the cache holds them (`heads`: cache_heads),
    every row at its last column, the sides taking turns."""
    heads, kv_heads, d = heads
    best = {}
    for dtype, n, c in itertools.product((torch.float32, torch.bfloat16), rows, columns):
        caches = filled_caches(CACHE_LAYERS, (n, kv_heads, c, d), dtype, huge=True)
        inputs = (torch.randn(n, heads, d), *torch.randn(2, n, kv_heads, d))
        inputs += (torch.arange(n), torch.full((n,), c - 1))
        call = functools.partial(attend_over, caches, *inputs)
        best.update(in_turns(libraries, {(n, c, dtype): call}, repeats))
    return best


def print_cache_attention(best: dict, heads: tuple[int, int, int], against: str) -> None:
    shape = "{} heads on {} key/value heads of {}".format(*heads)
    print(f"decode_layer.c's attention over {CACHE_LAYERS} layers' caches, {shape}")
    print(f"{cpu.name()} build, {torch.get_num_threads()} threads")
    print(f"cache | rows | columns | this tree ms | {against} ms | {against} / this tree")
    for n, c, dtype in dict.fromkeys(key for key, _ in best):
        ours, theirs = best[(n, c, dtype), "this tree"], best[(n, c, dtype), against]
        name = str(dtype).removeprefix("torch.")
        print(f"{name} | {n} | {c} | {ours * 1e3:.1f} | {theirs * 1e3:.1f} | {theirs / ours:.2f}x")


def print_attention(best: dict, shapes: list, against: str) -> None:
    print(f"attention.c, {cpu.name()} build, {torch.get_num_threads()} threads")
    columns = f"this tree ms | {against} ms | {against} / this tree"
    print(f"positions x heads/key heads x head size | {columns}")
    for shape in shapes:
        ours, theirs = best[shape, "this tree"], best[shape, against]
        name = attention_shape(*shape)
        print(f"{name} | {ours * 1e3:.2f} | {theirs * 1e3:.2f} | {theirs / ours:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", required=True, metavar="COMMIT")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--attention", action="store_true", help="attention.c alone")
    parser.add_argument(
        "--cache-attention", action="store_true", help="decode_layer.c's cache attention alone"
    )
    add_step_arguments(parser)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        libraries = {
            "this tree": cpu.load()[0],
            args.against: commit_library(args.against, Path(tmp)),
        }
        if args.attention:  # float_kernels' shapes: the vision tower's, a prompt's
            shapes = SMOKE_ATTENTION if args.smoke else ATTENTION
            best = attention(libraries, shapes, args.repeats * 5)
            print_attention(best, shapes, args.against)
            return
        ckpt, settings, rows, columns = step_inputs(args)
        if args.cache_attention:
            heads = cache_heads(ckpt)
            best = cache_attention(libraries, heads, rows, columns, args.repeats)
            print_cache_attention(best, heads, args.against)
            return
        best = steps(ckpt, settings, libraries, rows, columns, args.repeats)
    print(
        f"{ckpt.name}, settings {settings}, {cpu.name()} build, {torch.get_num_threads()} threads"
    )
    print(f"rows | columns | this tree ms | {args.against} ms | {args.against} / this tree")
    for n in rows:
        for c in columns:
            ours, theirs = best[(n, c), "this tree"], best[(n, c), args.against]
            print(f"{n} | {c} | {ours * 1e3:.1f} | {theirs * 1e3:.1f} | {theirs / ours:.2f}x")


if __name__ == "__main__":
    main()
