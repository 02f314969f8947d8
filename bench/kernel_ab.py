"""This tree's C kernels against another commit's, in one process: the same model, weights and
KV cache, the decode step run with each library in turns (the best of --repeats), so that
neither the host's placement of the pages nor a neighbour's load falls on one side only. The
Python side (the weights' layout, the scratch) is this tree's: it compares kernels whose
interface did not change, and the commit's C structs and declarations (kernels/cpu.py) must be
this tree's.

python bench/kernel_ab.py --against COMMIT [--smoke] [--settings '{"quantize": "int8"}']
    [--rows 1,8,32] [--columns 300,1000]
python bench/kernel_ab.py --against COMMIT --attention    (attention.c alone: ATTENTION_SHAPES)"""

from __future__ import annotations

import argparse
import ctypes
import re
import subprocess
import tempfile
import time
from pathlib import Path

import compare_hf
import torch
from decode_attention import add_step_arguments, step_inputs

from mmcli.api.labeler import Labeler
from mmcli.config import load_config
from mmcli.engine.batch import DecodeItem
from mmcli.kernels import cpu

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


def steps(ckpt: Path, settings: dict, libraries: dict, rows: list, columns: list, repeats: int):
    """{(rows, columns, side): the best decode step's seconds}, the sides taking turns."""
    engine = {"max_seqs": max(rows), "max_len": max(columns) + 1}
    cfg = load_config(None, {"device": "cpu", "engine": engine, **settings})
    runner = Labeler.from_pretrained(str(ckpt), config=cfg).runner
    runner.cache.grow(max(rows) + 1, max(columns) + 1)
    load, best = cpu.load, {}
    try:
        with torch.inference_mode():
            for attempt in range(repeats + 1):  # the first a warm-up
                for n in rows:
                    for c in columns:
                        items = [DecodeItem(i, 100 + i, c, 0) for i in range(n)]
                        for side, library in libraries.items():
                            cpu.load = lambda library=library: (library, "")
                            start = time.perf_counter()
                            runner.decode(items)
                            seconds = time.perf_counter() - start
                            if attempt:
                                key = (n, c, side)
                                best[key] = min(best.get(key, seconds), seconds)
    finally:
        cpu.load = load
    return best


# attention.c's shapes (positions, heads, key heads, head size, causal): the vision tower's at one
# 448x448 image, and a prompt's causal one with grouped key heads
ATTENTION_SHAPES = [(1024, 16, 16, 64, False), (280, 16, 8, 128, True)]


def attention_turns(libraries: dict, repeats: int) -> dict:
    """{(shape, side): attention.c's best seconds on that shape}, on this build's products
    (the tiles, AVX-512 BF16's pairs, else float32), the sides taking turns."""
    tiles, pairs = cpu.has_attention_pairs(tiles=True), cpu.has_attention_pairs()
    products = "tiles" if tiles else "pairs" if pairs else "float32"
    generator = torch.Generator().manual_seed(0)
    load, best = cpu.load, {}
    try:
        for shape in ATTENTION_SHAPES:
            positions, heads, key_heads, d, causal = shape
            q = torch.randn(positions, heads, d, generator=generator)
            k, v = (torch.randn(positions, key_heads, d, generator=generator) for _ in range(2))
            for attempt in range(repeats + 1):  # the first a warm-up
                for side, library in libraries.items():
                    cpu.load = lambda library=library: (library, "")
                    start = time.perf_counter()
                    cpu.attention(q, k, v, causal=causal, products=products)
                    seconds = time.perf_counter() - start
                    if attempt:
                        best[shape, side] = min(best.get((shape, side), seconds), seconds)
    finally:
        cpu.load = load
    return best


def print_attention(best: dict, against: str) -> None:
    print(f"attention.c, {cpu.name()} build, {torch.get_num_threads()} threads")
    columns = f"this tree ms | {against} ms | {against} / this tree"
    print(f"positions x heads/key heads x head size | {columns}")
    for positions, heads, key_heads, d, causal in ATTENTION_SHAPES:
        shape = (positions, heads, key_heads, d, causal)
        ours, theirs = best[shape, "this tree"], best[shape, against]
        name = f"{positions} x {heads}/{key_heads} x {d}{', causal' if causal else ''}"
        print(f"{name} | {ours * 1e3:.2f} | {theirs * 1e3:.2f} | {theirs / ours:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", required=True, metavar="COMMIT")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--attention", action="store_true", help="attention.c alone")
    add_step_arguments(parser)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        libraries = {
            "this tree": cpu.load()[0],
            args.against: commit_library(args.against, Path(tmp)),
        }
        if args.attention:
            print_attention(attention_turns(libraries, args.repeats * 5), args.against)
            return
        ckpt, settings, rows, columns = step_inputs(args)
        best = steps(ckpt, settings, libraries, rows, columns, args.repeats)
    print(
        f"{ckpt.name}, settings {settings}, {cpu.name()} build, {torch.get_num_threads()} threads"
    )
    print(f"rows | columns | this tree ms | {args.against} ms | {args.against} / this tree")
    for n in rows:
        for c in columns:
            ours, theirs = best[n, c, "this tree"], best[n, c, args.against]
            print(f"{n} | {c} | {ours * 1e3:.1f} | {theirs * 1e3:.1f} | {theirs / ours:.2f}x")


if __name__ == "__main__":
    main()
