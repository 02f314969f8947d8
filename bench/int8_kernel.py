"""The quantized kernels against the library's on the 2B model's shapes, in one run.

int8: GOP/s of mmcli's int8_linear.c (this CPU's build, and the AVX2 build where this CPU has
VNNI), of fbgemm's dynamic int8 linear (`torch.ops.quantized.linear_dynamic`, packed beforehand)
and of float32 `x @ w.T`, with fbgemm's packing time per weight, which int8_linear.c does not need.

int8 at a decode step's rows: GB/s of int8 weights read by int8_linear.c on the vector units and,
on AMX, on the tiles (the same integers: the build hands over at cpu.INT8_VNNI_ROWS).

int4 at a decode step's rows: GB/s of 4-bit weights (with their scales and zeros) read by the
kernels an int4 run takes on this build (amx.c's on AMX) and by torch's int4 kernel, cycling
through copies larger than the last-level cache as a model's layers do, against the read
bandwidth measured in the same run (measure.floors: a decode step's floor).

python bench/int8_kernel.py [--smoke]"""

from __future__ import annotations

import argparse
import os
import time
import warnings

import torch
from float_kernels import rows_table

from mmcli.kernels import cpu, measure
from mmcli.kernels.cpu_ops import amx_int4_matmul, int4_vnni_matmul, int8_matmul
from mmcli.models.layers.linear import Linear
from mmcli.weights.int8 import int8_linear

# (rows, out, in): decode, a few rows, the ask's prefill and vision, the decoder's down projection
SHAPES = [(1, 6144, 2048), (8, 6144, 2048), (219, 6144, 2048), (784, 4304, 1152), (219, 2048, 6144)]
SMOKE = [(1, 64, 96), (37, 80, 264)]
# int4: a decode step's rows of the 2B model's gate projection, and the copies cycled through
INT4_ROWS, INT4_SHAPE, INT4_COPIES = [1, 2, 3, 4, 8, 16, 32], (6144, 2048), 24
INT4_SMOKE = [1, 3, 5], (128, 64), 2
DECODE_ROWS = [1, 2, 4, 8, 12, 16, 32]


def best(fn, tries: int = 5) -> float:
    fn()
    times = []
    for _ in range(tries):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def ours(rows: int, out: int, width: int, build: str) -> float:
    """Seconds per call of the int8 Linear (activations quantized in the call, as a run does)."""
    before = os.environ.get("MMCLI_CPU_KERNEL")
    os.environ["MMCLI_CPU_KERNEL"] = "avx2" if build == "AVX2" else "1"
    cpu.load.cache_clear()
    layer = int8_linear(Linear(width, out, bias=False).requires_grad_(False))
    layer.kernel = int8_matmul  # what the kernel plan installs in an int8 run
    x = torch.randn(rows, width)
    seconds = best(lambda: layer(x))
    if before is None:
        del os.environ["MMCLI_CPU_KERNEL"]
    else:
        os.environ["MMCLI_CPU_KERNEL"] = before
    cpu.load.cache_clear()  # the build the environment names again
    return seconds


def fbgemm(rows: int, out: int, width: int) -> tuple[float, float]:
    """Seconds per call of fbgemm's dynamic int8 linear, and of packing its weight once."""
    weight = torch.randn(out, width)
    scale = (weight.abs().amax(1) / 127).double()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        q = torch.quantize_per_channel(
            weight, scale, torch.zeros(out, dtype=torch.long), 0, torch.qint8
        )
    pack = best(lambda: torch.ops.quantized.linear_prepack(q, None), 2)
    packed = torch.ops.quantized.linear_prepack(q, None)
    x = torch.randn(rows, width)
    return best(lambda: torch.ops.quantized.linear_dynamic(x, packed, True)), pack


def float32(rows: int, out: int, width: int) -> float:
    weight, x = torch.randn(out, width), torch.randn(rows, width)
    return best(lambda: x @ weight.t())


def int4_rates(rows: int, weights: list) -> tuple[str, float, float]:
    """(the kernel an int4 run takes at `rows`, its GB/s of weights, torch's int4 kernel's): the
    AMX build's, else int4_vnni.c where the build has it."""
    x = torch.randn(rows, weights[0].shape[1])
    nbytes = sum(w.packed.nbytes + w.scales_zeros.nbytes for w in weights)
    matmul = amx_int4_matmul if cpu.name() == "AMX" else int4_vnni_matmul
    read_forms = [cpu.int4_read_form(w) for w in weights]  # the scales as our build reads them
    ours = matmul(x, read_forms[0], None) is not None
    name = cpu.amx_int4_kernel(rows) if cpu.name() == "AMX" else "int4_vnni.c"
    kernel = name if ours else "torch int4"
    library = best(lambda: [measure.torch_int4(x, w) for w in weights])
    mine = best(lambda: [matmul(x, w, None) for w in read_forms]) if ours else library
    return kernel, nbytes / mine / 1e9, nbytes / library / 1e9


def int8_rows_table(smoke: bool) -> None:
    """GB/s of int8 weights (values only) read at a decode step's rows, each kernel the AMX build
    can take."""
    rows, (out, width), copies = INT4_SMOKE if smoke else (DECODE_ROWS, INT4_SHAPE, INT4_COPIES)
    weights = [measure.random_int8(out, width)[0] for _ in range(copies)]
    vnni_rows = {"vector units": 1 << 30} | ({"AMX tiles": 0} if cpu.name() == "AMX" else {})
    passes = {
        name: lambda x, v=v: [cpu.int8_linear(x, w, v) for w in weights]
        for name, v in vnni_rows.items()
    }
    title = f"int8, {copies} copies of {out} x {width} ({cpu.name()} build)"
    rows_table(title, passes, rows, width, sum(w.values.nbytes for w in weights))


def int4_table(smoke: bool) -> None:
    rows, (out, width), copies = INT4_SMOKE if smoke else (INT4_ROWS, INT4_SHAPE, INT4_COPIES)
    weights = [measure.random_int4(out, width) for _ in range(copies)]
    read = measure.floors()["read_gb_s"]
    print(f"\nint4, {copies} copies of {out} x {width}; read bandwidth {read:.1f} GB/s")
    print("| rows | kernel | GB/s | torch int4 GB/s | against torch | share of the bandwidth |")
    print("|---|---|---|---|---|---|")
    for n in rows:
        kernel, mine, library = int4_rates(n, weights)
        cells = [kernel, f"{mine:.1f}", f"{library:.1f}", f"{mine / library:.2f}x"]
        print(f"| {n} | {' | '.join(cells)} | {mine / read:.0%} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes")
    args = parser.parse_args()
    if cpu.load()[0] is None:
        raise SystemExit(f"int8_linear.c does not build here: {cpu.load()[1]}")
    builds = [cpu.name()] + (["AVX2"] if cpu.has_vnni() else [])
    has_fbgemm = "fbgemm" in torch.backends.quantized.supported_engines
    print(f"{torch.get_num_threads()} threads; GOP/s (2 x rows x out x in / s)")
    print(f"| rows x out x in | {' | '.join(builds)} | fbgemm (its packing) | float32 |")
    print("|---|" + "---|" * (len(builds) + 2))
    for rows, out, width in SMOKE if args.smoke else SHAPES:
        ops = 2 * rows * out * width
        cells = [f"{ops / ours(rows, out, width, b) / 1e9:.0f}" for b in builds]
        if has_fbgemm:
            call, pack = fbgemm(rows, out, width)
            cells.append(f"{ops / call / 1e9:.0f} ({pack * 1e3:.0f} ms)")
        else:
            cells.append("-")
        cells.append(f"{ops / float32(rows, out, width) / 1e9:.0f}")
        print(f"| {rows} x {out} x {width} | {' | '.join(cells)} |")
    int8_rows_table(args.smoke)
    int4_table(args.smoke)


if __name__ == "__main__":
    main()
