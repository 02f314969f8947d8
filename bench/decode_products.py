"""A decode step's products, kernel by kernel, against their floors, in one process: each kernel
a step multiplies on (bfloat16 products, or bfloat16 weights widened to float32 products where
the build has no bfloat16 ones; int8, int4) at R rows of the 2B model's gate projection
(6144 x 2048), timed three ways in turns, the best of 5 (and of --rounds passes over every kernel
and row count: a neighbour's burst of a few seconds falls on one pass): hot (one copy of the
weights, from the caches: its arithmetic alone), cold (COPIES copies cycled, far more than the
last-level cache, as a step streams its layers) and a stream of the same bytes (both cores). Hot
against the unit's peak says how fast the kernel multiplies; cold against the larger of hot and
the stream, how far its reads overlap its products; cold against its floor (the larger of its
bytes over that stream and its FLOPs over the unit's peak) is what (e')'s layers are made of.

python bench/decode_products.py [--smoke] [--rows 1,8,32] [--rounds 3]"""

from __future__ import annotations

import argparse

import torch
from cpu import best_seconds

from mmcli.kernels import cpu, measure
from mmcli.kernels.host_memory import keep_freed_memory

SHAPE, COPIES = (6144, 2048), 24  # the gate projection; 24 copies: 170 MB of int4 and more
SMOKE_SHAPE, SMOKE_COPIES = (128, 64), 2


def weights(kind: str, outer: int, inner: int):
    """Random weights in the form `kind`'s kernel reads (for timing)."""
    if kind == "int8":
        return measure.random_int8(outer, inner)[0]
    if kind == "int4":
        return cpu.int4_read_form(measure.random_int4(outer, inner))
    return torch.randn(outer, inner).bfloat16()


def tensors(weight) -> list[torch.Tensor]:
    """A weight's tensors: a quantized form's own, or the bfloat16 matrix."""
    return [weight] if isinstance(weight, torch.Tensor) else list(weight.tensors().values())


def widened_products(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """bfloat16 weights widened to float32 products (bf16_linear.c): the default path's step
    where the build has no bfloat16 products (AVX2, AVX-512 without BF16); None elsewhere."""
    if cpu.name() in cpu.BF16_DOT_BUILDS:
        return None
    return cpu.bf16_linear(x, weight)


KERNELS = {
    "bfloat16": lambda x, w: cpu.bf16_rows_linear(x, w, False),
    "float32": widened_products,
    "int8": lambda x, w: cpu.int8_linear(x, w),
    "int4": cpu.int4_vnni_linear,
}


def unit(kind: str) -> str:
    """The unit a kind's kernel multiplies on: int8's dot products for int8 and int4 (int4_vnni.c
    quantizes the rows to int8), bfloat16's or float32's FMAs for the bfloat16 weights."""
    return kind if kind in ("bfloat16", "float32") else "int8"


def timings(kind: str, rows: int, shape: tuple[int, int], copies: int) -> dict | None:
    """Seconds per product hot and cold, and per stream of one copy's bytes; None where this
    build has no such kernel."""
    held = [weights(kind, *shape) for _ in range(copies)]
    x = torch.randn(rows, shape[1])
    kernel = KERNELS[kind]
    if kernel(x, held[0]) is None:
        return None
    pages = [t.reshape(-1).view(torch.uint8) for w in held for t in tensors(w)]
    hot, cold, stream = best_seconds(
        lambda: [kernel(x, held[0]) for _ in held],
        lambda: [kernel(x, w) for w in held],
        lambda: [t.amax() for t in pages],
    )
    nbytes = sum(t.numel() for t in pages) / copies
    return {"hot": hot / copies, "cold": cold / copies, "stream": stream / copies, "bytes": nbytes}


def best_of(rounds: list[dict]) -> dict:
    """Each timing's best over the rounds."""
    return {key: min(r[key] for r in rounds) for key in rounds[0]}


def row(kind: str, rows: int, t: dict, peak: float, shape: tuple[int, int]) -> str:
    flops = 2 * rows * shape[0] * shape[1]
    floor = max(t["stream"], flops / peak)
    bound = "memory" if t["stream"] >= flops / peak else unit(kind)
    return (
        f"{kind} | {rows} | {t['hot'] * 1e3:.3f} ms, {flops / t['hot'] / 1e9:.0f} G(FL)OP/s, "
        f"{flops / t['hot'] / peak:.0%} of peak | {t['stream'] * 1e3:.3f} ms, "
        f"{t['bytes'] / t['stream'] / 1e9:.1f} GB/s | {t['cold'] * 1e3:.3f} ms | "
        f"{t['cold'] / max(t['hot'], t['stream']):.2f}x | {floor * 1e3:.3f} ms ({bound}), "
        f"{t['cold'] / floor:.2f}x"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny shape, two copies")
    parser.add_argument("--rows", default="1,8,32")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if cpu.why_unavailable() is not None:
        raise SystemExit(f"the kernels do not run here: {cpu.why_unavailable()}")
    keep_freed_memory()  # the copies' pages kept, as a loaded model's are
    shape, copies = (SMOKE_SHAPE, SMOKE_COPIES) if args.smoke else (SHAPE, COPIES)
    peaks = measure.peaks()  # G(FL)OP/s
    print(
        f"{shape[0]}x{shape[1]}, {copies} copies, {cpu.name()} build, "
        f"{torch.get_num_threads()} threads; peaks "
        + ", ".join(f"{u} {rate:.0f}" for u, rate in peaks.items())
        + " G(FL)OP/s"
    )
    print("kernel | rows | hot | stream of its bytes | cold | cold / max(hot, stream) | floor")
    cases = [(kind, int(r)) for r in args.rows.split(",") for kind in KERNELS]
    rounds = [
        [timings(kind, rows, shape, copies) for kind, rows in cases] for _ in range(args.rounds)
    ]
    for n, (kind, rows) in enumerate(cases):
        if rounds[0][n] is None:
            print(f"{kind} | {rows} | not in this build")
            continue
        t = best_of([r[n] for r in rounds])
        print(row(kind, rows, t, peaks[unit(kind)] * 1e9, shape))


if __name__ == "__main__":
    main()
