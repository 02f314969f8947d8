"""Where two kernels are close on this machine, which one wins at which row count: measured once
per machine (its CPU model, cores, units, our kernels' build and code, torch: `machine_key`) and
cached in ~/.cache/mmcli/kernels/measured.json, so a run pays nothing for it after the first.

Each comparison times both kernels on a representative layer at a few row counts (best of
REPEATS) and keeps the rates (GFLOP/s, GOP/s for int8), so that `mmcli doctor` can print them
against the machine's peak for each unit (`peaks`: the library's own GEMM at 2048 cubed, 1024 for
bfloat16 where the CPU has no bfloat16 products)."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from mmcli.kernels import attention, cpu, cpu_features, cpu_ops, matrix
from mmcli.kernels.weight_forms import GROUP, Int4Weight, Int8Weight

REPEATS = 3
STORE = "measured.json"
SHAPE = (2048, 6144)  # a 2B model's fused q/k/v and gate/up widths: in -> out
BF16_ROWS = (1, 4, 8, 16, 32, 64)
INT4_ROWS = (16, 32, 64, 128, 256, 1024)
INT4_FEWEST_ROWS = (1, 2)  # a decode step's fewest: where torch's int4 kernel may win
INT8_STEP_ROWS = (1, 2, 4, 8, 16)  # where AMX's int8 tiles may or may not outrun the dot products
INT4_STEP_ROWS = (3, 4, 6, 8, 16, 32)  # a step's rows past torch's int4 kernel's
STREAMED_LAYERS = 12  # int4 SHAPE layers past the caches, read once a pass as a step reads them
INT8_ROWS = (64, 256, 1024)
VISION_ROWS = 784  # a 448x448 image's patches
INT4_INT8 = f"int4_vnni.c to {cpu.AMX_ROWS} rows, widened to int8 above"


def _seconds(fn: Callable[[], object]) -> float:
    fn()
    best = float("inf")
    for _ in range(REPEATS):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _rate(fn: Callable[[], object], ops: float) -> float:
    return ops / _seconds(fn) / 1e9


MARGIN = 1.1  # the library's kernel must be this much faster: a close call keeps ours


def crossover(rates: dict[int, tuple[float, float]]) -> int | None:
    """The row count above which the library's kernel (second) wins by MARGIN at every measured
    count from there on: the last count where it did not (0: it wins at all; None: at none)."""
    counts = sorted(rates)
    losing = [rows for rows in counts if rates[rows][1] < MARGIN * rates[rows][0]]
    if not losing:
        return 0
    if losing[-1] == counts[-1]:
        return None
    return losing[-1]


def _bf16_gemm() -> dict:
    """Ours against oneDNN's bfloat16 GEMM: bf16_dot.c's bfloat16 products where this build has
    them (AVX-512 BF16), else bf16_linear.c's float32 ones."""
    inner, outer = SHAPE
    weight = torch.randn(outer, inner).mul_(0.02).bfloat16()
    dot = cpu.name() in cpu.BF16_DOT_BUILDS

    def ours(x):
        if dot:
            return cpu.bf16_dot_linear(x, weight, False)
        return cpu_ops.bf16_matmul(x, weight, None, None)

    rates = {}
    for rows in BF16_ROWS:
        x = torch.randn(rows, inner)
        ops = 2 * rows * inner * outer
        rates[rows] = (
            _rate(lambda x=x: ours(x), ops),
            _rate(lambda x=x: matrix.bf16_linear(x, weight, None, None), ops),
        )
    return {
        "kernels": ["bf16_dot.c" if dot else "bf16_linear.c", "oneDNN bfloat16"],
        "units": ["bfloat16" if dot else "float32", "bfloat16"],
        "rates": rates,
    }


def random_int8(outer: int, inner: int) -> tuple[Int8Weight, Int8Weight]:
    """Random int8 weights (for timing) in int8_linear.c's layout and in rows layout."""
    values = torch.randint(-127, 128, (outer, inner), dtype=torch.int8)
    weight = Int8Weight(
        values, torch.rand(outer), values.sum(1, dtype=torch.int32), torch.zeros(outer)
    )
    return weight, dataclasses.replace(weight, layout="rows")


def random_int4(outer: int, inner: int) -> Int4Weight:
    """Random 4-bit weights (for timing) in torch's int4 CPU layout, the scales by group (our
    kernels take them as cpu.int4_read_form puts them)."""
    q = torch.randint(0, 16, (outer, inner), dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    scales_zeros = torch.rand(inner // GROUP, outer, 2).bfloat16()
    return Int4Weight(packed, scales_zeros, (outer, inner))


def torch_int4(x: torch.Tensor, weight: Int4Weight) -> torch.Tensor:
    x2, weight = x.to(torch.bfloat16), weight.torch_form()  # torch's kernel reads its own layout
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x2, weight.packed, GROUP, weight.scales_zeros)


def _int8_vision() -> dict:
    inner, outer = 1024, 4096  # the vision tower's MLP
    weight, rows_form = random_int8(outer, inner)
    x = torch.randn(VISION_ROWS, inner)
    ops = 2 * VISION_ROWS * inner * outer
    rates = {
        VISION_ROWS: (
            _rate(lambda: cpu_ops.int8_matmul(x, weight), ops),
            _rate(lambda: matrix.int8_rows_matmul(x, rows_form), ops),
        )
    }
    return {"kernels": ["int8_linear.c", "oneDNN int8"], "units": ["int8", "int8"], "rates": rates}


def _int8_prefill() -> dict:
    inner, outer = SHAPE
    weight, _ = random_int8(outer, inner)
    above = matrix.int8_products(0)
    rates = {}
    for rows in INT8_ROWS:
        x = torch.randn(rows, inner)
        ops = 2 * rows * inner * outer
        rates[rows] = (
            _rate(lambda x=x: cpu_ops.int8_matmul(x, weight), ops),
            _rate(lambda x=x: above(x, weight), ops),
        )
    kernels = ["int8_linear.c", "oneDNN int8, weights copied to rows"]
    return {"kernels": kernels, "units": ["int8", "int8"], "rates": rates}


def _int4_tiles() -> dict:
    """Ours against the dequantized tiles on oneDNN's GEMM in the products an int4 run has here
    (bfloat16 where the CPU multiplies it, else float32): the int8 dot products where this build
    has int4_vnni.c (a step's rows on it, more widened to int8), else torch's int4 kernel."""
    inner = outer = 2048
    weight = random_int4(outer, inner)
    read_form = cpu.int4_read_form(weight)
    library = cpu.load()[0]
    vnni = library is not None and library.int4_vnni
    label = INT4_INT8 if vnni and library.int4_widened else f"int4_vnni.c to {cpu.AMX_ROWS} rows"
    products = "bfloat16" if cpu_features.detect().bf16_matrix() else "float32"

    def ours(x):  # torch's int4 kernel where int4_vnni.c does not take the rows
        y = cpu.int4_int8_linear(x, read_form) if vnni else None
        return torch_int4(x, weight) if y is None else y

    rates = {}
    for rows in INT4_ROWS:
        x = torch.randn(rows, inner)
        ops = 2 * rows * inner * outer
        rates[rows] = (
            _rate(lambda x=x: ours(x), ops),
            _rate(lambda x=x: matrix.int4_tiles_linear(x, weight, None, products), ops),
        )
    return {
        "kernels": [label if vnni else "torch int4", f"int4 tiles + oneDNN {products}"],
        "units": ["int8" if vnni else "float32", products],
        "rates": rates,
    }


def _step_rates(weights: list, counts: tuple[int, ...], sides: tuple) -> dict:
    """Each side's rate (side(x, weight), G(OP)/s) over `weights` (of SHAPE, read from memory as
    a decode step reads them) at each of a step's row counts."""
    inner, outer = SHAPE
    rates = {}
    for rows in counts:
        x = torch.randn(rows, inner)
        ops = 2 * rows * inner * outer * len(weights)
        rates[rows] = tuple(
            _rate(lambda x=x, side=side: [side(x, w) for w in weights], ops) for side in sides
        )
    return rates


def _int4_fewest_rows() -> dict:
    """int4_vnni.c against torch's int4 kernel at a decode step's fewest rows, the weights read
    from memory as a step reads them (STREAMED_LAYERS of them, past the caches)."""
    inner, outer = SHAPE
    weights = [random_int4(outer, inner) for _ in range(STREAMED_LAYERS)]
    read_forms = {id(w): cpu.int4_read_form(w) for w in weights}  # as the loader puts them

    def ours(x, weight):
        return cpu.int4_vnni_linear(x, read_forms[id(weight)])

    rates = _step_rates(weights, INT4_FEWEST_ROWS, (ours, torch_int4))
    return {"kernels": ["int4_vnni.c", "torch int4"], "units": ["int8", "float32"], "rates": rates}


def _int8_step_rows() -> dict:
    """int8_linear.c's AMX build at a decode step's rows, the weights read from memory as a step
    reads them (STREAMED_LAYERS of them): the vector units' dot products against the tiles, the
    same integers. Which reads the weights faster moved from one AMX machine to the next."""
    inner, outer = SHAPE
    weights = [random_int8(outer, inner)[0] for _ in range(STREAMED_LAYERS)]
    sides = tuple(functools.partial(cpu.int8_linear, vnni_rows=v) for v in (cpu.AMX_ROWS, 0))
    rates = _step_rates(weights, INT8_STEP_ROWS, sides)
    kernels = ["int8_linear.c on VNNI", "int8_linear.c on AMX tiles"]
    return {"kernels": kernels, "units": ["int8", "int8"], "rates": rates}


def _int4_step_rows() -> dict:
    """int4_vnni.c's AMX build at a decode step's rows, the weights read from memory as a step
    reads them (STREAMED_LAYERS of them): the vector units' int8 dot products against the
    tiles', the same integers and floats."""
    inner, outer = SHAPE
    weights = [cpu.int4_read_form(random_int4(outer, inner)) for _ in range(STREAMED_LAYERS)]
    sides = tuple(functools.partial(cpu.amx_int4_gemm, vnni_rows=v) for v in (cpu.AMX_ROWS, 0))
    rates = _step_rates(weights, INT4_STEP_ROWS, sides)
    kernels = ["int4_vnni.c on VNNI", "int4_vnni.c on AMX tiles"]
    return {"kernels": kernels, "units": ["int8", "int8"], "rates": rates}


def _attention() -> dict:
    """A 448x448 image's attention in the vision tower (16 heads of 64): attention.c, on
    bfloat16 pairs where this build has them (on the tiles in the AMX build), against torch's
    flash attention on bfloat16."""
    q, k, v = (torch.randn(1024, 16, 64) for _ in range(3))
    ops = 4 * 1024 * 1024 * 16 * 64
    tiles = cpu.has_attention_pairs(tiles=True)
    pairs = tiles or cpu.has_attention_pairs()
    ours = functools.partial(cpu_ops.attention_pairs, tiles=tiles) if pairs else cpu_ops.attention
    rates = {
        1024: (
            _rate(lambda: ours(q, k, v), ops),
            _rate(lambda: attention.bf16_attention(q, k, v), ops),
        )
    }
    on = " on the AMX tiles" if tiles else " on bfloat16 pairs" if pairs else ""
    return {
        "kernels": [
            f"attention.c{on}",
            "flash attention bfloat16",
        ],
        "units": ["bfloat16" if pairs else "float32", "bfloat16"],
        "rates": rates,
    }


PEAK_SIDE = 2048  # each unit's peak on PEAK_SIDE-cubed products
PEAK_PROMPT_ROWS = 256  # and int8_linear.c's on a prompt's rows of SHAPE


def peak_kernels() -> dict[str, dict[str, tuple[Callable[[], object], float]]]:
    """Each unit's kernels that `peaks` times, with their operations: float32 FMA (MKL/oneDNN),
    bfloat16 (oneDNN: the matrix engine where there is one) and int8: oneDNN's where its sums
    are exact (VNNI, AMX-INT8) or nothing else runs int8, and wherever our build runs
    int8_linear.c's (AMX's tiles, VNNI's or AVX2's dot products) with the weights as it reads
    them and the rows already in levels, as torch._int_mm's; and int4_vnni.c's at a decode
    step's most rows (its int8 products, summed in int16 on AVX2). On an AVX2 CPU oneDNN's int8
    runs at a fortieth of int8_linear.c's (46 s to time on a Zen 1, for a kernel the plan never
    takes there), int8_linear.c at PEAK_SIDE rows (its levels past L2) at 0.8x its rate at a
    prompt's, and int4_vnni.c at 1.1x that: a peak below a kernel's rate is no floor. A CPU
    without bfloat16 products runs oneDNN's bfloat16 GEMM in software, at PEAK_SIDE // 2 cubed:
    on a 2-core Zen 3 at the same 14-17 G(FL)OP/s in 0.5 s, where PEAK_SIDE took 4.4-5.1 s, half
    of a first run's measurements."""
    a = torch.randn(PEAK_SIDE, PEAK_SIDE)
    b16_side = PEAK_SIDE if cpu_features.detect().bf16_matrix() else PEAK_SIDE // 2
    b16 = a[:b16_side, :b16_side].bfloat16()
    cube = 2 * PEAK_SIDE**3
    int8 = {}
    if cpu_features.exact_int8() or not cpu.name():
        i8 = torch.randint(-63, 64, (PEAK_SIDE, PEAK_SIDE), dtype=torch.int8)
        int8["oneDNN int8"] = (lambda: torch._int_mm(i8, i8), cube)
    if cpu.name():
        for rows, (inner, outer) in ((PEAK_SIDE, (PEAK_SIDE,) * 2), (PEAK_PROMPT_ROWS, SHAPE)):
            weight, _ = random_int8(outer, inner)
            levels, scale = cpu.int8_rows(a[:rows, :inner].contiguous(), inner)
            ops = 2 * rows * inner * outer
            product = functools.partial(cpu.int8_products, levels, scale, weight)
            int8[f"int8_linear.c, {rows} rows"] = (product, ops)
    if cpu.name() and cpu.load()[0].int4_vnni:  # AVX2's int16 sums outrun int8_linear.c's
        weight4 = cpu.int4_read_form(random_int4(PEAK_SIDE, PEAK_SIDE))
        x = a[: cpu.AMX_ROWS].contiguous()
        ops = 2 * cpu.AMX_ROWS * PEAK_SIDE**2
        int8[f"int4_vnni.c, {cpu.AMX_ROWS} rows"] = (lambda: cpu.int4_vnni_linear(x, weight4), ops)
    return {
        "float32": {"float32 GEMM": (lambda: F.linear(a, a), cube)},
        "bfloat16": {"oneDNN bfloat16": (lambda: F.linear(b16, b16), 2 * b16_side**3)},
        "int8": int8,
    }


def peaks() -> dict:
    """Each unit's peak: the best rate of its kernels (peak_kernels), G(FL)OP/s."""
    return {
        unit: max(_rate(kernel, ops) for kernel, ops in kernels.values())
        for unit, kernels in peak_kernels().items()
    }


BANDWIDTH_BYTES = 1 << 30  # read once a pass: far past any cache, as a decode step's weights


def floors() -> dict:
    """What bounds a decode step from below: the read bandwidth (GB/s) both cores see
    streaming a GiB once (the best of REPEATS passes)."""
    stream = torch.ones(BANDWIDTH_BYTES // 4)
    return {"read_gb_s": BANDWIDTH_BYTES / _seconds(stream.sum) / 1e9}


COMPARISONS: dict[str, Callable[[], dict]] = {
    "bf16_gemm": _bf16_gemm,
    "int8_vision": _int8_vision,
    "int8_prefill": _int8_prefill,
    "int4_tiles": _int4_tiles,
    "int4_fewest_rows": _int4_fewest_rows,
    "int8_step_rows": _int8_step_rows,
    "int4_step_rows": _int4_step_rows,
    "attention": _attention,
    "peaks": peaks,
    "floors": floors,
}


def store_path():
    return cpu.cache_dir() / STORE


def _read() -> dict:
    try:
        return json.loads(store_path().read_text())
    except (OSError, ValueError):
        return {}


def _write(store: dict) -> None:
    path = store_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    # written aside, renamed: a concurrent run reads the old file or the new, never half
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(store, f, indent=1)
    os.replace(tmp, path)


@functools.cache
def code_digest() -> str:
    """A digest of the kernels compared (ours in C and their callers, the library's callers) and
    of what is measured on them (this module): a new mmcli measures again."""
    here = Path(__file__).parent
    sources = [
        *cpu.SOURCES,
        *cpu.AMX_SOURCES,
        *cpu.BF16_SOURCES,
        *cpu.HEADERS,
        here / "cpu_ops.py",
        here / "matrix.py",
        Path(__file__),
    ]
    return hashlib.sha256(b"".join(p.read_bytes() for p in sources)).hexdigest()[:12]


def machine_key(units: cpu_features.CpuFeatures, build: str) -> str:
    """What a measurement is valid for: the CPU, its units, our kernels' build and code, torch."""
    built = build or "no C build"
    return f"{units.key(torch.__version__)}|{built}|kernels {code_digest()}"


def measured(name: str, key: str, again: bool = False) -> dict:
    """The comparison `name` on the machine of `key`: from the cache, else measured now and
    cached. Row counts come back as ints."""
    store = _read()
    entry = store.get(key, {})
    if again or name not in entry:
        entry[name] = COMPARISONS[name]()
        store = _read()  # another run may have written meanwhile: keep its entries
        store[key] = {**store.get(key, {}), name: entry[name]}
        _write(store)
    result = dict(entry[name])
    if "rates" in result:
        result["rates"] = {int(rows): tuple(pair) for rows, pair in result["rates"].items()}
    return result
