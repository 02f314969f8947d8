"""The default CPU path's kernels against what they replace, on the 2B model's shapes, in one run:
bf16_linear.c's GEMM (bfloat16 weights, float32 arithmetic; this CPU's build and the AVX2 one)
against the chunked path it replaced (each chunk of weights converted, then MKL) and against MKL on
float32 weights; attention.c against torch's SDPA on the vision tower's shapes and, causal with
grouped query heads, on the decoder prefill's (and where the build has them, its bfloat16
products against torch's flash attention on bfloat16, shares of the bfloat16 peak); rms_norm.c
against torch's rms_norm (microseconds a call: too small for a share of the peak); and where the
few-rows kernel (decode) hands over to the GEMM (linear.KERNEL_ROWS). Each figure is a share of
the float32 matmul peak (2048-cubed)
measured just before it, the median of --repeats rounds (this shared machine's peak moves by up
to 2x within a minute). Weights cycle through copies larger than the last-level cache, as a
model's do. Last, at a decode step's rows, the GB/s of bfloat16 weights each few-rows kernel reads
(bf16_linear.c, amx.c's tiles on AMX, oneDNN's bfloat16 linear) against the read bandwidth measured
in the same run (measure.floors: a decode step's floor).

python bench/float_kernels.py [--smoke] [--repeats 7]

As an AVX2 machine would run it, on an AVX-512 one (MKL, ATen and our kernels at AVX2):
MKL_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2 MMCLI_CPU_KERNEL=avx2 \
    python bench/float_kernels.py"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

from mmcli.kernels import attention, cpu, measure
from mmcli.kernels.cpu_ops import bf16_matmul
from mmcli.models.layers.linear import upcast_linear

# (rows, out, in): the ask's vision tower (784 patches) and prefill (219 tokens)
GEMMS = [
    (784, 3072, 1024),
    (784, 4096, 1024),
    (784, 1024, 4096),
    (219, 6144, 2048),
    (219, 2048, 6144),
    (219, 2048, 2048),
]
SMOKE_GEMMS = [(25, 70, 300)]
# (positions, heads, key/value heads, head_dim, causal): the vision tower on one 448x448 image and
# one of 896x896, the decoder's prefill of the ask's 219 tokens
ATTENTION = [(784, 16, 16, 64, False), (3136, 16, 16, 64, False), (219, 16, 8, 128, True)]
SMOKE_ATTENTION = [(100, 2, 2, 64, False), (50, 4, 2, 32, True)]
# (rows, width): a decode step's norms (the hidden state, 16 query heads), the prefill's
NORMS = [(1, 2048), (16, 128), (219, 2048)]
CROSSOVER_ROWS = [8, 12, 16, 24, 32]
# a decode step's rows of the 2B model's gate projection, and the copies cycled through
DECODE_ROWS, DECODE_SHAPE, DECODE_COPIES = [1, 2, 4, 8, 16, 32], (6144, 2048), 24
DECODE_SMOKE = [1, 3], (128, 64), 2


def seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


THIS_CPU = os.environ.get("MMCLI_CPU_KERNEL", "1")  # avx2: as an AVX2 machine would


def build(name: str) -> None:
    """Load this CPU's build, the AVX2 one, or none (the chunked path)."""
    os.environ["MMCLI_CPU_KERNEL"] = {"this CPU's": THIS_CPU, "AVX2": "avx2", "none": "0"}[name]
    cpu.load.cache_clear()


def rounds(variants: dict, flops: float, repeats: int, peak) -> dict[str, float]:
    """Each variant's median share of the matmul peak measured just before its call."""
    shares = {name: [] for name in variants}
    for _ in range(repeats):
        for name, (setup, fn) in variants.items():
            setup()
            fn()  # warm: the kernel loaded, the buffers sized
            at = peak()
            shares[name].append(flops / seconds(fn) / at)
    return {name: statistics.median(values) for name, values in shares.items()}


def gemm_row(rows: int, out: int, width: int, builds: list[str], repeats: int, peak) -> str:
    copies = max(3, int(200e6 // (out * width * 2)))
    weights = [torch.randn(out, width).bfloat16() for _ in range(copies)]
    full = [w.float() for w in weights[:3]]
    x, turn = torch.randn(rows, width), iter(range(1 << 30))

    def ours():  # as a Linear with bfloat16 weights runs: the kernel where it loads, else chunks
        weight = weights[next(turn) % copies]
        y = bf16_matmul(x, weight, None, None)
        return y if y is not None else upcast_linear(x, weight, None)

    variants = {b: (lambda b=b: build(b), ours) for b in [*builds, "none"]}
    variants["MKL, float32 weights"] = (lambda: None, lambda: x @ full[next(turn) % 3].t())
    shares = rounds(variants, 2 * rows * out * width, repeats, peak)
    build(builds[0])
    return f"| {rows} x {out} x {width} | " + " | ".join(f"{s:.0%}" for s in shares.values()) + " |"


def attention_inputs(positions: int, heads: int, kv_heads: int, d: int) -> tuple:
    """q, k and v as the model holds them: q as the rotary leaves it, v a view."""
    q = torch.randn(positions, heads, d)
    kv = torch.randn(positions, 2, kv_heads, d)
    return q, kv[:, 0].contiguous(), kv[:, 1]


def attention_shape(positions: int, heads: int, kv_heads: int, d: int, causal: bool) -> str:
    return f"{positions} x {heads}/{kv_heads} x {d}{', causal' if causal else ''}"


def attention_row(
    positions: int, heads: int, kv_heads: int, d: int, causal: bool, repeats: int, peak
) -> str:
    q, k, v = attention_inputs(positions, heads, kv_heads, d)

    def sdpa():
        return F.scaled_dot_product_attention(
            *(t.transpose(0, 1)[None] for t in (q, k, v)), is_causal=causal, enable_gqa=True
        )

    variants = {
        "ours": (lambda: None, lambda: cpu.attention(q, k, v, causal)),
        "torch SDPA": (lambda: None, sdpa),
    }
    flops = 4 * positions**2 * heads * d // (2 if causal else 1)
    shares = rounds(variants, flops, repeats, peak)
    shape = attention_shape(positions, heads, kv_heads, d, causal)
    return f"| {shape} | " + " | ".join(f"{s:.0%}" for s in shares.values()) + " |"


def bf16_attention_row(
    positions: int, heads: int, kv_heads: int, d: int, causal: bool, repeats: int, peak
) -> str:
    """attention.c's bfloat16 products (each this build has: AVX-512 BF16's dot products, the
    AMX tiles) against torch's flash attention on bfloat16, each from float32 q, k, v as the
    model holds them: shares of the bfloat16 matmul peak."""
    q, k, v = attention_inputs(positions, heads, kv_heads, d)
    variants = {
        products: (lambda: None, lambda p=products: cpu.attention(q, k, v, causal, p))
        for products in bf16_attention_products()
    }
    variants["flash"] = (lambda: None, lambda: attention.bf16_attention(q, k, v, causal))
    flops = 4 * positions**2 * heads * d // (2 if causal else 1)
    shares = rounds(variants, flops, repeats, peak)
    shape = attention_shape(positions, heads, kv_heads, d, causal)
    return f"| {shape} | " + " | ".join(f"{s:.0%}" for s in shares.values()) + " |"


def bf16_attention_products() -> list[str]:
    """attention.c's bfloat16 products in this build."""
    tiles = ["tiles"] if cpu.has_attention_pairs(tiles=True) else []
    return (["pairs"] if cpu.has_attention_pairs() else []) + tiles


def norm_row(rows: int, width: int, repeats: int) -> str:
    """rms_norm.c against torch's rms_norm: each one's median microseconds a call."""
    x, weight = torch.randn(rows, width), torch.randn(width)
    calls = {
        "ours": lambda: cpu.rms_norm(x, weight, 1e-6),
        "torch": lambda: F.rms_norm(x, (width,), weight, 1e-6),
    }
    times = {name: [] for name in calls}
    for _ in range(repeats):
        for name, fn in calls.items():
            fn()
            times[name].append(seconds(lambda fn=fn: [fn() for _ in range(200)]) / 200 * 1e6)
    ours, torch_us = (statistics.median(times[name]) for name in calls)
    return f"| {rows} x {width} | {ours:.1f} | {torch_us:.1f} | {torch_us / ours:.1f}x |"


def magnitude_row(name: str, activation, repeats: int) -> str:
    """An activation of pointwise.c on a vision MLP's 1024 x 4096 outputs of deviation 1 and
    32 (a random GEMM's over 1024 inputs): median milliseconds a call. Its exponential stops at
    a normal float, so the larger values cost no more (a subnormal costs a microcode assist)."""
    calls = {}
    for deviation in (1, 32):
        values = (torch.randn(1024, 4096) * deviation).bfloat16()
        calls[deviation] = lambda values=values: activation(values)
    times = {deviation: [] for deviation in calls}
    for _ in range(repeats):
        for deviation, fn in calls.items():
            fn()
            times[deviation].append(seconds(fn) * 1e3)
    small, large = (statistics.median(times[deviation]) for deviation in calls)
    return f"| {name} | {small:.2f} | {large:.2f} | {large / small:.2f}x |"


def crossover_row(rows: int, out: int, width: int, repeats: int, peak) -> str:
    """The few-rows kernel and the GEMM on the same rows: shares of the peak."""
    copies = max(3, int(200e6 // (out * width * 2)))
    weights = [torch.randn(out, width).bfloat16() for _ in range(copies)]
    x, turn = torch.randn(rows, width), iter(range(1 << 30))
    variants = {
        "few rows": (lambda: None, lambda: cpu.bf16_linear(x, weights[next(turn) % copies])),
        "GEMM": (lambda: None, lambda: cpu.bf16_gemm(x, weights[next(turn) % copies], None)),
    }
    shares = rounds(variants, 2 * rows * out * width, repeats, peak)
    return f"| {rows} x {out} x {width} | " + " | ".join(f"{v:.0%}" for v in shares.values()) + " |"


def decode_table(smoke: bool) -> None:
    """GB/s of bfloat16 weights read by each few-rows kernel at a decode step's rows."""
    rows, (out, width), copies = (
        DECODE_SMOKE if smoke else (DECODE_ROWS, DECODE_SHAPE, DECODE_COPIES)
    )
    weights = [torch.randn(out, width).bfloat16() for _ in range(copies)]
    kernels = {"bf16_linear.c": cpu.bf16_linear}
    if cpu.name() == "AMX":
        kernels["amx.c tiles"] = lambda x, w: cpu.amx_bf16_linear(x, w, False)
    if cpu.name() in cpu.BF16_DOT_BUILDS:
        kernels["bf16_dot.c"] = lambda x, w: cpu.bf16_dot_linear(x, w, False)
        kernels["bf16_dot.c split"] = lambda x, w: cpu.bf16_dot_linear(x, w, True)
    kernels["oneDNN bfloat16"] = lambda x, w: F.linear(x.bfloat16(), w)
    passes = {
        name: lambda x, kernel=kernel: [kernel(x, w) for w in weights]
        for name, kernel in kernels.items()
    }
    title = f"bfloat16, {copies} copies of {out} x {width}"
    rows_table(title, passes, rows, width, sum(w.nbytes for w in weights))


def rows_table(title: str, passes: dict, rows: list[int], width: int, nbytes: int) -> None:
    """GB/s at a decode step's rows: each of `passes` (x -> one pass over `nbytes` of weights
    larger than the last-level cache) the best of 3, against the read bandwidth measured now."""
    read = measure.floors()["read_gb_s"]
    print(f"\n{title}; GB/s of weights (share of the read bandwidth, {read:.1f} GB/s)")
    print(f"| rows | {' | '.join(passes)} |")
    print("|---|" + "---|" * len(passes))
    for n in rows:
        x = torch.randn(n, width)
        rates = [nbytes / _best_pass(one_pass, x) / 1e9 for one_pass in passes.values()]
        print(f"| {n} | " + " | ".join(f"{r:.1f} ({r / read:.0%})" for r in rates) + " |")


def _best_pass(one_pass, x: torch.Tensor) -> float:
    one_pass(x)  # warm: the kernel loaded, its buffers sized
    return min(seconds(lambda: one_pass(x)) for _ in range(3))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, one round")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    repeats = 1 if args.smoke else args.repeats
    if cpu.load()[0] is None:
        raise SystemExit(f"the kernels do not build here: {cpu.load()[1]}")
    builds = ["this CPU's"] + (["AVX2"] if cpu.name() != "AVX2" else [])
    square = torch.randn(2048, 2048)
    square @ square

    def peak() -> float:
        return 2 * 2048**3 / min(seconds(lambda: square @ square) for _ in range(2))

    print(
        f"{torch.get_num_threads()} threads; shares of the float32 matmul peak, the median of "
        f"{repeats} rounds"
    )
    names = [cpu.name(), *builds[1:]]
    print(
        f"| rows x out x in | ours, {' | ours, '.join(names)} | chunks + MKL | MKL, float32 "
        "weights |"
    )
    print("|---|" + "---|" * (len(builds) + 2))
    for shape in SMOKE_GEMMS if args.smoke else GEMMS:
        print(gemm_row(*shape, builds, repeats, peak), flush=True)
    print(f"\n| positions x heads/key heads x head_dim | ours ({cpu.name()}) | torch SDPA |")
    print("|---|---|---|")
    for shape in SMOKE_ATTENTION if args.smoke else ATTENTION:
        print(attention_row(*shape, repeats, peak), flush=True)
    if bf16_attention_products():
        square16 = square.bfloat16()

        def peak16() -> float:
            return 2 * 2048**3 / min(seconds(lambda: square16 @ square16) for _ in range(2))

        products = bf16_attention_products()
        print("\nbfloat16 products, shares of the bfloat16 matmul peak:")
        print(
            f"| positions x heads/key heads x head_dim | ours, {' | ours, '.join(products)} | "
            "flash attention bfloat16 |"
        )
        print("|---|" + "---|" * (len(products) + 1))
        for shape in SMOKE_ATTENTION if args.smoke else ATTENTION:
            print(bf16_attention_row(*shape, repeats, peak16), flush=True)
    print("\n| RMSNorm rows x width | ours (us a call) | torch (us) | torch / ours |")
    print("|---|---|---|---|")
    for shape in NORMS[:1] if args.smoke else NORMS:
        print(norm_row(*shape, repeats), flush=True)
    print("\n| activation, 1024 x 4096 | deviation 1 (ms) | deviation 32 (ms) | 32 / 1 |")
    print("|---|---|---|---|")
    activations = {
        "GELU (tanh), bfloat16 products widened": lambda v: cpu.widen_outputs(
            v, None, "gelu_tanh", True
        ),
        "SiLU(gate) x up, bfloat16": lambda v: cpu.silu_times_rounded(v, v),
    }
    for name, activation in activations.items():
        print(magnitude_row(name, activation, repeats), flush=True)
    print(f"\n| rows x out x in | few-rows kernel ({cpu.name()}) | GEMM |")
    print("|---|---|---|")
    for rows in CROSSOVER_ROWS[:1] if args.smoke else CROSSOVER_ROWS:
        print(crossover_row(rows, *((64, 96) if args.smoke else (6144, 2048)), repeats, peak))
    decode_table(args.smoke)


if __name__ == "__main__":
    main()
