"""Our CPU kernels, built on first use: `bf16_linear.c`, bfloat16 weights with float32 activations
(a few-rows kernel for decode and a GEMM for prefill and vision), `attention.c`, the vision tower's
attention and the decoder's prefill attention, both on the float32 tiles of `float_tiles.h`,
`rms_norm.c` (the decoder's norms in one call each), `pointwise.c` (the rotary and the SwiGLU, one
pass each), `decode_layer.c` (a dense decoder layer's step for a few tokens in one call),
`int8_linear.c`, int8 weights in a layout that is stored as it runs, and `int8_weights.c`, which
quantizes a checkpoint's weights into that layout in one pass; where the CPU has them, `amx.c` (the
AMX tiles) and `bf16_dot.c` (AVX-512 BF16's dot products: bfloat16 products of a few rows).

PyTorch has no bfloat16-weight, float32-activation kernel: its bfloat16 GEMM rounds the
activations, and converting weights in one call and multiplying in another writes and reads a
float32 copy of each. Ours widen the weights in registers or in a cache-resident panel (a bfloat16
is the top half of a float32: exact), so decode reads 2 bytes a parameter and every product is
float32.

They are compiled with the system C compiler (as Inductor compiles its CPU kernels) into
~/.cache/mmcli/kernels, linked to the OpenMP runtime torch itself loaded so that both share one
thread pool; with AVX-512 (and VNNI, int8's vpdpbusd) where the CPU has it. Where the CPU lacks
AVX2/FMA, no compiler is found or the build fails, `load` returns None with the reason and the
caller keeps the portable path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from mmcli.kernels import cpu_features, weight_forms
from mmcli.paths import mmcli_cache

SOURCES = [
    Path(__file__).parent / "csrc" / name
    for name in (
        *("bf16_linear.c", "attention.c", "rms_norm.c", "layer_norm.c"),
        *("pointwise.c", "decode_layer.c", "int8_linear.c", "int8_weights.c", "int4_tiles.c"),
        *("int4_vnni.c", "delta_rule.c"),
    )
]
HEADERS = [
    Path(__file__).parent / "csrc" / name for name in ("vectors.h", "float_tiles.h", "amx_tiles.h")
]
# the tiles' kernels, in the AMX build only (their instructions exist nowhere else)
AMX_SOURCES = [Path(__file__).parent / "csrc" / "amx.c"]
# AVX-512 BF16's dot products, in the builds for CPUs that have them (AMX's and the BF16 one)
BF16_SOURCES = [Path(__file__).parent / "csrc" / "bf16_dot.c"]
# int4_vnni.c (int4 on int8 dot products) in every build: VNNI's with VBMI's byte permutes in the
# AVX-512 builds of CPUs that have them (and the widening of a prompt's rows), else AVX2's
VBMI_FLAGS = ["-mavx512vbmi"]
FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-fPIC"]
VNNI_FLAGS = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"]
BF16_FLAGS = [*VNNI_FLAGS, "-mavx512bf16"]
AMX_FLAGS = [*BF16_FLAGS, "-mavx512vbmi", "-mamx-tile", "-mamx-bf16", "-mamx-int8"]
AMX_UNITS = frozenset({"amx_bf16", "amx_int8", "avx512_bf16", "avx512_vnni"})


def has_vnni() -> bool:
    """AVX-512 VNNI (and BW), from the kernel's CPU flags; MMCLI_CPU_KERNEL=avx2, or an
    MMCLI_CPU_FEATURES without avx512_vnni, leaves it out."""
    forced = cpu_features.detect()
    if os.environ.get("MMCLI_CPU_KERNEL") == "avx2" or (
        forced.overridden and "avx512_vnni" not in forced.units
    ):
        return False
    return {"avx512_vnni", "avx512bw", "avx512vl"} <= _cpu_flags()


def _cpu_flags() -> set[str]:
    """The kernel's flags for the CPU (x86's /proc/cpuinfo), empty where it has none."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return set(next((line.split() for line in text.splitlines() if line.startswith("flags")), []))


def has_vbmi() -> bool:
    """AVX-512 VBMI among the kernel's CPU flags (AMD Zen 4 and 5, Intel since Ice Lake; not
    Cascade or Cooper Lake)."""
    return "avx512vbmi" in _cpu_flags()


def has_amx() -> bool:
    """AMX-BF16 and AMX-INT8 (with AVX-512 BF16 and VNNI) among the CPU's real units and the
    units the plan sees: MMCLI_CPU_FEATURES can take them out of our build, never put them in."""
    return AMX_UNITS <= cpu_features.real_units() & cpu_features.detect().units and has_vnni()


def has_bf16_dot() -> bool:
    """AVX-512 BF16 (with VNNI) among the CPU's real units and the units the plan sees."""
    units = cpu_features.real_units() & cpu_features.detect().units
    return "avx512_bf16" in units and has_vnni()


def cache_dir() -> Path:
    return mmcli_cache() / "kernels"


def why_unavailable() -> str | None:
    """None if the kernel can be built and run here, else the reason (in words)."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return f"the CPU's capability is {torch.backends.cpu.get_cpu_capability()}, not AVX2"
    if os.environ.get("MMCLI_CPU_KERNEL", "1") == "0":
        return "MMCLI_CPU_KERNEL=0"
    if not shutil.which(compiler()):
        return f"no C compiler ({compiler()}) on PATH"
    return None


def compiler() -> str:
    """The C compiler our kernels are built with: $CC, else cc."""
    return os.environ.get("CC", "cc")


def _build(
    compiler: str, torch_lib: Path, extra: list[str], sources: list[Path], headers=HEADERS
) -> Path:
    """The library of `sources` (including `headers`, beside them), built once per code and
    flags in the kernel cache."""
    compile_flags, libraries = [*FLAGS, *extra], []
    # torch's own OpenMP runtime, already loaded: one thread pool
    if (torch_lib / "libgomp.so.1").exists():
        libraries = [f"-L{torch_lib}", f"-Wl,-rpath,{torch_lib}"]
    code = b"".join(source.read_bytes() for source in [*sources, *headers])
    flags = " ".join([compiler, *compile_flags, *libraries]).encode()
    digest = hashlib.sha256(code + flags).hexdigest()[:16]
    target = cache_dir() / f"linear-{digest}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        # built aside, renamed: concurrent runs are safe
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            objects = [str(Path(tmp) / f"{source.stem}.o") for source in sources]
            _run_together(
                [compiler, *compile_flags, "-c", str(source), "-o", obj]
                for source, obj in zip(sources, objects)
            )
            built = Path(tmp) / target.name
            link = [compiler, "-shared", "-fopenmp", *objects, *libraries, "-o", str(built)]
            _run_together([link])
            os.replace(built, target)
    return target


def _run_together(commands) -> None:
    """Run the commands at once (a source file each: the build takes its longest file's time,
    not the sum), raising CalledProcessError, with its stderr, for the first that fails."""
    running = [
        (command, subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
        for command in commands
    ]
    failed = None
    for command, process in running:
        try:
            out, err = process.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            process.kill()
            out, err = process.communicate()
        if process.returncode and failed is None:
            failed = subprocess.CalledProcessError(process.returncode, command, out, err)
    if failed is not None:
        raise failed


class DecodeMatrix(ctypes.Structure):
    """decode_layer.c's struct decode_matrix: a linear's bfloat16 weights (values only), its
    Int8Weight's tensors or its Int4Weight's (values: the packed ones, and scales_zeros; in the
    blocks form where int4_blocks is set)."""

    _fields_ = [
        (name, ctypes.c_void_p) for name in ("values", "sums", "scale", "bias", "scales_zeros")
    ]
    _fields_ += [("int4_blocks", ctypes.c_int64)]


class DecodeLayer(ctypes.Structure):
    """decode_layer.c's struct decode_layer: one layer's weights and sizes."""

    _fields_ = [(name, ctypes.c_void_p) for name in ("input_norm", "post_norm", "q_norm", "k_norm")]
    _fields_ += [(name, DecodeMatrix) for name in ("q", "k", "v", "o", "gate", "up", "down")]
    _fields_ += [
        (name, ctypes.c_int64) for name in ("hidden", "heads", "kv_heads", "d", "intermediate")
    ]
    _fields_ += [("eps", ctypes.c_float), ("bf16_products", ctypes.c_int32)]
    _fields_ += [("int8", ctypes.c_int32)]
    _fields_ += [("vnni_rows", ctypes.c_int64), ("int4", ctypes.c_int32)]
    _fields_ += [("int4_vnni_rows", ctypes.c_int64)]


@functools.cache
def load() -> tuple[ctypes.CDLL | None, str]:
    """(the library, "") or (None, why not); built once per machine, cached."""
    reason = why_unavailable()
    if reason:
        return None, reason
    # the AMX build, else the VNNI one where the CPU has them; what the compiler cannot make, the
    # next (AVX2 last)
    builds = [("AMX", AMX_FLAGS, [*SOURCES, *AMX_SOURCES, *BF16_SOURCES])] if has_amx() else []
    builds += [("AVX-512 BF16", BF16_FLAGS, [*SOURCES, *BF16_SOURCES])] if has_bf16_dot() else []
    builds += [("AVX-512 VNNI", VNNI_FLAGS, SOURCES)] if has_vnni() else []
    # every AVX-512 build takes VBMI where the CPU has it (AMX's flags have it)
    vbmi = VBMI_FLAGS if has_vbmi() else []
    builds = [(build, [*flags, *vbmi], sources) for build, flags, sources in builds]
    for build, extra, sources in [*builds, ("AVX2", [], SOURCES)]:
        try:
            torch_lib = Path(torch.__file__).parent / "lib"
            path = _build(compiler(), torch_lib, extra, sources)
            library = ctypes.CDLL(str(path))
            library.build, library.sources, library.flags = build, sources, extra
            # int4_vnni.c reads blocks of 64 output channels with VBMI (torch's AVX-512 layout),
            # else 32 (its AVX2 one): its kernels run where torch packs int4 so here; a prompt's
            # rows are widened to int8 with VBMI and in the AVX2 build (to 7-bit levels there,
            # which keep vpmaddubsw's pairs from saturating); an AVX-512 build without VBMI has
            # tiles wider than its blocks
            vbmi = VBMI_FLAGS[0] in extra
            library.int4_widened = vbmi or build == "AVX2"
            library.int4_widened_top = 127 if vbmi else 63  # a widened weight's largest level
            block = 64 if vbmi else 32
            library.int4_vnni = weight_forms.int4_block() == block
            # int4_vnni.c's AVX2 half reads the blocks form too (Int4Weight.in_blocks)
            library.int4_blocks = not vbmi
            break
        except (OSError, subprocess.SubprocessError) as error:
            detail = getattr(error, "stderr", b"") or b""
            reason = (
                f"building {' and '.join(s.name for s in SOURCES)} failed: {error} "
                f"{detail.decode(errors='replace')[:300]}".strip()
            )
    else:
        return None, reason
    _declare(library)
    return library, ""


# the builds with bf16_dot.c
BF16_DOT_BUILDS = ("AMX", "AVX-512 BF16")


def _declare(library: ctypes.CDLL) -> None:
    """The C functions' argument and result types."""
    library.bf16_linear.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    library.bf16_linear.restype = None
    library.bf16_pairs.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2
    library.bf16_pairs.restype = None
    library.bf16_gemm.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int] * 2
    library.bf16_gemm.restype = None
    library.attention.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64] * 3
    # out, out_row, queries, keys, heads, group, causal, d, threads
    library.attention.argtypes += [ctypes.c_void_p] + [ctypes.c_int64] * 5 + [ctypes.c_int]
    # d, products, threads
    library.attention.argtypes += [ctypes.c_int64, ctypes.c_int, ctypes.c_int]
    library.attention.restype = ctypes.c_int
    library.rms_norm.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
    library.rms_norm.argtypes += [ctypes.c_int64] * 2 + [ctypes.c_float, ctypes.c_int]
    library.rms_norm.restype = None
    # x, update, update_bf16, sum, weight, out, rounded, rows, width, eps, threads
    library.add_rms_norm.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int] + [ctypes.c_void_p] * 3
    library.add_rms_norm.argtypes += [ctypes.c_int] + [ctypes.c_int64] * 2
    library.add_rms_norm.argtypes += [ctypes.c_float, ctypes.c_int]
    library.add_rms_norm.restype = None
    # x, update, update_bf16, sum, weight, bias, out, rounded, rows, width, eps, threads
    library.add_layer_norm.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int] + [ctypes.c_void_p] * 4
    library.add_layer_norm.argtypes += [ctypes.c_int] + [ctypes.c_int64] * 2
    library.add_layer_norm.argtypes += [ctypes.c_float, ctypes.c_int]
    library.add_layer_norm.restype = None
    library.rotary.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    library.rotary.argtypes += [ctypes.c_int64] * 3 + [ctypes.c_void_p] * 2 + [ctypes.c_int64]
    library.rotary.argtypes += [ctypes.c_int]
    library.rotary.restype = None
    # x, x_bf16, x_row, x_head, out, rows, heads, d, weight, eps, cos, sin, rot, threads
    library.norm_rotary.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    library.norm_rotary.argtypes += [ctypes.c_void_p] + [ctypes.c_int64] * 3
    library.norm_rotary.argtypes += [ctypes.c_void_p, ctypes.c_float] + [ctypes.c_void_p] * 2
    library.norm_rotary.argtypes += [ctypes.c_int64, ctypes.c_int]
    library.norm_rotary.restype = None
    library.silu_times.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64, ctypes.c_int]
    library.silu_times.restype = None
    library.silu_times_rounded.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64, ctypes.c_int]
    library.silu_times_rounded.restype = None
    library.widen_outputs.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2
    library.widen_outputs.argtypes += [ctypes.c_int] * 3
    library.widen_outputs.restype = None
    if library.build in BF16_DOT_BUILDS:
        library.bf16_dot_linear.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3
        library.bf16_dot_linear.argtypes += [ctypes.c_int] * 2
    if library.build == "AMX":
        library.amx_bf16_linear.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3
        library.amx_bf16_linear.argtypes += [ctypes.c_int] * 2
    _declare_decode(library)
    _declare_quantized(library)


def _declare_decode(library: ctypes.CDLL) -> None:
    """The decode steps' kernels' argument and result types: a dense layer's, an attention's
    alone, Gated DeltaNet's rule's."""
    library.decode_layer.argtypes = [ctypes.POINTER(DecodeLayer), ctypes.c_void_p, ctypes.c_int64]
    library.decode_layer.argtypes += [ctypes.c_void_p] * 2 + [ctypes.c_int64, ctypes.c_int]
    library.decode_layer.argtypes += [ctypes.c_void_p] * 5 + [ctypes.c_int]
    library.decode_layer.restype = None
    # q, k, v, k_cache, v_cache, columns, kv_bf16, slots, positions, rows, heads, kv_heads, d,
    # out, threads
    library.decode_attention.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64, ctypes.c_int]
    library.decode_attention.argtypes += [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 4
    library.decode_attention.argtypes += [ctypes.c_void_p, ctypes.c_int]
    library.decode_attention.restype = ctypes.c_int
    # q, k, v, decay, beta, states, slots, out, rows, heads, dk, dv, threads
    library.delta_step.argtypes = [ctypes.c_void_p] * 8 + [ctypes.c_int64] * 4 + [ctypes.c_int]
    library.delta_step.restype = ctypes.c_int


def _declare_quantized(library: ctypes.CDLL) -> None:
    """The int8 and int4 kernels' argument and result types."""
    library.int8_linear.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 4 + [ctypes.c_int] * 2
    library.int8_linear.restype = None
    library.quantize_rows.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 2 + [ctypes.c_void_p]
    library.quantize_rows.argtypes += [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
    library.quantize_rows.restype = None
    library.int8_linear_wide.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 3
    library.int8_linear_wide.argtypes += [ctypes.c_int]
    library.int8_linear_wide.restype = None
    library.quantize_rows_wide.argtypes = library.quantize_rows.argtypes
    library.quantize_rows_wide.restype = None
    library.quantize_weights.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
    library.quantize_weights.argtypes += [ctypes.c_int64] * 2 + [ctypes.c_void_p] * 3
    library.quantize_weights.argtypes += [ctypes.c_int64] * 2 + [ctypes.c_int]
    library.quantize_weights.restype = None
    library.int4_dequantize.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 6
    library.int4_dequantize.argtypes += [ctypes.c_void_p, ctypes.c_int]
    library.int4_dequantize.restype = None
    int4 = ("amx_int4_gemm", "amx_int4_rows") if library.build == "AMX" else ()
    vnni = ("int4_vnni_rows", "int4_widened_rows") if library.int4_widened else ("int4_vnni_rows",)
    tiles = ("int4_tile_rows",) if library.int4_vnni and library.build == "AMX" else ()
    for name in (*int4, *vnni, *tiles):
        kernel = getattr(library, name)
        # x, packed, scales_zeros, blocks, y, M, N, K, threads
        kernel.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int, ctypes.c_void_p]
        kernel.argtypes += [ctypes.c_int64] * 3 + [ctypes.c_int]
    if library.int4_vnni:
        library.int4_quantize_rows.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 2
        library.int4_quantize_rows.argtypes += [ctypes.c_void_p] * 3 + [ctypes.c_int]
        library.int4_quantize_rows.restype = None


def eager() -> bool:
    """Whether the kernels can run here and now: loaded, and not inside a graph being traced
    (torch.compile cannot trace a ctypes call; the traced graph keeps torch's operations)."""
    return not torch.compiler.is_compiling() and load()[0] is not None


def name() -> str:
    """Which build runs here, in words ("" when none does)."""
    library = load()[0]
    return library.build if library is not None else ""


def _products(kernel, x: torch.Tensor, weight: torch.Tensor, *flags: int):
    """(y, status) of a kernel (x, w, y, M, N, K, *flags, threads) for x (M, K) and w (N, K)."""
    rows, width = x.shape
    out = torch.empty(rows, weight.shape[0], dtype=torch.float32)
    threads = torch.get_num_threads()
    args = (x.data_ptr(), weight.data_ptr(), out.data_ptr(), rows, weight.shape[0], width)
    return out, kernel(*args, *flags, threads)


def bf16_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x (rows, K) float32 @ weight.T with weight (N, K) bfloat16, both contiguous on the CPU;
    float32 out."""
    library, reason = load()
    if library is None:
        raise RuntimeError(reason)
    pairs = torch.empty_like(x)
    library.bf16_pairs(x.data_ptr(), pairs.data_ptr(), *x.shape)
    return _products(library.bf16_linear, pairs, weight)[0]


# the rows amx_bf16_linear takes (64 columns of B: 32 rows split in two)
AMX_ROWS = 32


def amx_bf16_linear(x: torch.Tensor, weight: torch.Tensor, split: bool) -> torch.Tensor | None:
    """x (rows, K) float32 @ weight.T (N, K) bfloat16 on the AMX tiles (amx.c), float32 out: x
    rounded to bfloat16, or with `split` as two bfloat16 (16 bits of each value); None where
    this build, the shapes or the kernel's row limit do not fit it."""
    library = load()[0]
    if library is None or library.build != "AMX":
        return None
    out, status = _products(library.amx_bf16_linear, x, weight, int(split))
    return None if status else out


def bf16_dot_linear(x: torch.Tensor, weight: torch.Tensor, split: bool) -> torch.Tensor | None:
    """x (rows, K) float32 @ weight.T (N, K) bfloat16 on AVX-512 BF16's dot products (bf16_dot.c),
    float32 out: x rounded to bfloat16, or with `split` as two bfloat16 (16 bits of each value);
    None where this build has no such kernel."""
    library = load()[0]
    if library is None or library.build not in BF16_DOT_BUILDS:
        return None
    out, status = _products(library.bf16_dot_linear, x, weight, int(split))
    if status:
        raise MemoryError("bf16_dot.c could not allocate its rows")
    return out


def bf16_rows_linear(x: torch.Tensor, weight: torch.Tensor, split: bool) -> torch.Tensor | None:
    """bfloat16 products of a few rows (up to AMX_ROWS) on this build's unit for them: the AMX
    tiles (amx.c), else AVX-512 BF16's dot products (bf16_dot.c); None where neither is built or
    the shapes are not the kernel's."""
    if name() == "AMX":
        return amx_bf16_linear(x, weight, split)
    return bf16_dot_linear(x, weight, split)


# int4 on the AMX build: to INT4_TORCH_ROWS rows torch's int4 kernel (ours only matches it there:
# bench/int8_kernel.py), then int4_vnni.c's int8 products, each row quantized to int8 per group:
# the vector units' (int4_vnni_rows) to INT4_VNNI_ROWS (the plan's measured crossover where it
# has one: int4_step_rows), the tiles' (int4_tile_rows: the same integers and floats) above, to
# AMX_ROWS; more rows widened to int8 for the tiles' int8 products (int4_widened_rows: 1.5-1.9x
# amx_int4_gemm's panels dequantized to bfloat16). A build without int4_vnni.c: amx.c's tiles on
# the weights' integers to INT4_FEW_ROWS (amx_int4_rows), its panels above.
INT4_TORCH_ROWS, INT4_VNNI_ROWS, INT4_FEW_ROWS = 2, 8, 16


def amx_int4_kernel(rows: int, int4_vnni: bool = True, vnni_rows: int = INT4_VNNI_ROWS) -> str:
    """The AMX build's int4 kernel for `rows` rows (its name in amx.c or int4_vnni.c), with
    int4_vnni.c in the build (its vector units' products to `vnni_rows`) or without (no VBMI:
    amx.c's alone)."""
    if not int4_vnni:
        return "amx_int4_rows" if rows <= INT4_FEW_ROWS else "amx_int4_gemm"
    if rows <= vnni_rows:
        return "int4_vnni_rows"
    return "int4_tile_rows" if rows <= AMX_ROWS else "int4_widened_rows"


def amx_int4_gemm(x: torch.Tensor, weight, vnni_rows: int = INT4_VNNI_ROWS) -> torch.Tensor | None:
    """x (rows, K) float32 @ W.T for an Int4Weight W (torch's CPU layout, group 32) on the AMX
    build, float32 out: to AMX_ROWS rows quantized to int8 per group of 32 inputs (on the vector
    units to `vnni_rows`, the tiles above), more to 8 bits a row against the weights widened to
    int8 (see INT4_VNNI_ROWS); None where this build or the shapes (N a multiple of 64, K of 32)
    do not fit."""
    library = load()[0]
    if library is None or library.build != "AMX":
        return None
    name = amx_int4_kernel(x.shape[0], library.int4_vnni, vnni_rows)
    # int4_vnni.c quantizes float32 rows itself; amx.c's tiles take them rounded to bfloat16
    quantized = name.startswith("int4_")
    x_in = x.float() if quantized else x.to(torch.bfloat16)
    return _int4_products(getattr(library, name), x_in.contiguous(), weight)


def int4_read_form(weight):
    """An Int4Weight in the form this build's int4_vnni.c reads fastest (a copy in the blocks
    form in its AVX2 half): the loader's, for weights made elsewhere (measurements)."""
    library = load()[0]
    if library is None or not library.int4_blocks:
        return weight
    return weight.in_blocks(weight_forms.int4_block())


def int4_vnni_linear(x: torch.Tensor, weight) -> torch.Tensor | None:
    """x (rows, K) float32 @ W.T for an Int4Weight W on the vector units' int8 dot products
    (int4_vnni.c), each row quantized to int8 per group of 32 inputs, float32 out; None where
    this build has no such kernel (no VBMI) or the shapes (N a multiple of 64, K of 32) do not
    fit."""
    library = load()[0]
    if library is None or not library.int4_vnni:
        return None
    return _int4_products(library.int4_vnni_rows, x.float().contiguous(), weight)


def int4_int8_linear(x: torch.Tensor, weight) -> torch.Tensor | None:
    """x (rows, K) float32 @ W.T for an Int4Weight W on the int8 dot products: a decode step's
    rows (to AMX_ROWS) on int4_vnni.c's, quantized to int8 per group of 32 inputs; a prompt's
    more rows widened to int8 (int4_widened_linear), at the int8 rate. None as those give it."""
    if x.shape[0] > AMX_ROWS:
        return int4_widened_linear(x, weight)
    return int4_vnni_linear(x, weight)


def int4_widened_linear(x: torch.Tensor, weight) -> torch.Tensor | None:
    """x (rows, K) float32 @ W.T for an Int4Weight W on int8_linear.c's tiles, each block of
    channels widened to int8 levels (a scale a channel; at most library.int4_widened_top: 127
    with VBMI, 63 on AVX2) and each row to 8 bits (a scale a row), float32 out; None where this
    build does not widen (AVX-512 without VBMI) or the shapes do not fit."""
    library = load()[0]
    if library is None or not library.int4_widened:
        return None
    return _int4_products(library.int4_widened_rows, x.float().contiguous(), weight)


def int4_quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """x (rows, K) float32, contiguous, K a multiple of 32, as int4_vnni.c's products take it:
    each group of 32 inputs as int8 levels, the group's scale and the sum of its levels; None
    where this build has no int4_vnni.c."""
    library = load()[0]
    if library is None or not library.int4_vnni:
        return None
    rows, width = x.shape
    if width % 32 or not x.is_contiguous() or x.dtype != torch.float32:
        raise ValueError(f"int4 rows: float32, contiguous, a multiple of 32 wide, not {x.shape}")
    levels = torch.empty(rows, width, dtype=torch.int8)
    scales, sums = torch.empty(rows, width // 32), torch.empty(rows, width // 32, dtype=torch.int32)
    library.int4_quantize_rows(
        x.data_ptr(),
        rows,
        width,
        levels.data_ptr(),
        scales.data_ptr(),
        sums.data_ptr(),
        torch.get_num_threads(),
    )
    return levels, scales, sums


def _int4_products(kernel, x: torch.Tensor, weight) -> torch.Tensor | None:
    """An int4 kernel's (x, packed, scales_zeros, blocks, y, M, N, K, threads) float32 y, or
    None where it refused the shapes or the weights' form (or they are not contiguous)."""
    if not weight.scales_zeros.is_contiguous():
        return None
    out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32)
    blocks = int(weight.layout == "blocks")
    status = kernel(
        x.data_ptr(), weight.packed.data_ptr(), weight.scales_zeros.data_ptr(), blocks,
        out.data_ptr(), x.shape[0], weight.shape[0], x.shape[1], torch.get_num_threads(),
    )  # fmt: skip
    return None if status else out


# bf16_gemm's activations (bf16_linear.c's enum activation)
ACTIVATIONS = {None: 0, "gelu_tanh": 1}
NORM_WIDTH = 16  # the add-and-norm kernels' rows: whole vectors in either build
MAX_HEAD = 512  # the values of a head pointwise.c's norm_rotary holds


def bf16_gemm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None = None
) -> torch.Tensor:
    """activation(x (rows, K) float32 @ weight.T + bias) with weight (N, K) bfloat16, all
    contiguous on the CPU; float32 out. For many rows: see bf16_linear.c."""
    library, reason = load()
    if library is None:
        raise RuntimeError(reason)
    rows, width = x.shape
    out = torch.empty(rows, weight.shape[0], dtype=torch.float32)
    bias = None if bias is None else bias.float().contiguous()
    library.bf16_gemm(
        x.data_ptr(),
        weight.data_ptr(),
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
        rows,
        weight.shape[0],
        width,
        ACTIVATIONS[activation],
        torch.get_num_threads(),
    )
    return out


# attention.c's products: float32, bfloat16 pairs on AVX-512 BF16's dot products or on the tiles
ATTENTION_PRODUCTS = {"float32": 0, "pairs": 1, "tiles": 2}


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    products: str = "float32",
) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v for q [queries, heads, d] and k, v [keys, kv_heads, d] (float32
    on the CPU, any row and head strides, d contiguous; heads a multiple of kv_heads), without a
    mask or causal (query i sees keys up to i + keys - queries); out [queries, heads, d].
    `products`: one of ATTENTION_PRODUCTS, the bfloat16 ones where the build has them
    (attention_pairs()). See attention.c."""
    library, reason = load()
    if library is None:
        raise RuntimeError(reason)
    (queries, heads, d), (keys, kv_heads) = q.shape, k.shape[:2]
    if heads % kv_heads or k.shape != v.shape:
        raise ValueError(f"q's {heads} heads against k {tuple(k.shape)} and v {tuple(v.shape)}")
    out = torch.empty(queries, heads, d)
    strided = [value for t in (q, k, v) for value in (t.data_ptr(), t.stride(0), t.stride(1))]
    shape = (queries, keys, heads, heads // kv_heads, int(causal), d)
    threads = torch.get_num_threads()
    code = ATTENTION_PRODUCTS[products]
    status = library.attention(*strided, out.data_ptr(), heads * d, *shape, code, threads)
    if status == -2:
        raise RuntimeError(f"the {library.build} build has no {products} products for attention.c")
    if status == -3:
        raise RuntimeError("Linux did not grant this process the AMX tiles")
    if status:
        raise MemoryError("attention.c could not allocate its scratch")
    return out


def has_attention_pairs(tiles: bool = False) -> bool:
    """Whether this build's attention.c multiplies on bfloat16 pairs (AVX-512 BF16), or with
    `tiles` on the AMX tiles."""
    return name() == "AMX" if tiles else name() in BF16_DOT_BUILDS


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x / sqrt(mean(x^2) + eps)) over x's last dimension: x float32 on the CPU with
    that dimension contiguous and the rest flattening to rows; weight float32, contiguous."""
    library, reason = load()
    if library is None:
        raise RuntimeError(reason)
    rows = x.reshape(-1, x.shape[-1])
    out = torch.empty(x.shape)
    library.rms_norm(
        rows.data_ptr(),
        rows.stride(0),
        weight.data_ptr(),
        out.data_ptr(),
        rows.shape[0],
        rows.shape[1],
        eps,
        torch.get_num_threads(),
    )
    return out


def add_rms_norm(
    x: torch.Tensor,
    update: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    rounded: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + update, rms_norm(x + update)) in one pass (rms_norm.c); see _add_norm."""
    return _add_norm("add_rms_norm", x, update, [weight], eps, rounded)


def add_layer_norm(
    x: torch.Tensor,
    update: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    rounded: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + update, layer_norm(x + update)) in one pass (layer_norm.c); see _add_norm."""
    return _add_norm("add_layer_norm", x, update, [weight, bias], eps, rounded)


def _add_norm(
    name: str,
    x: torch.Tensor,
    update: torch.Tensor | None,
    params: list[torch.Tensor],
    eps: float,
    rounded: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A norm's kernel with the residual stream's add before it: x float32, contiguous, its last
    dimension a multiple of NORM_WIDTH; update of x's shape, contiguous, float32 or bfloat16 (a
    product's outputs handed on), or None (the sum is x); params float32, contiguous.
    `rounded`: the norm's output in bfloat16, each value rounded as torch rounds float32."""
    library, reason = load()
    if library is None:
        raise RuntimeError(reason)
    width = x.shape[-1]
    total = torch.empty(x.shape) if update is not None else x
    out = torch.empty(x.shape, dtype=torch.bfloat16 if rounded else torch.float32)
    getattr(library, name)(
        x.data_ptr(),
        update.data_ptr() if update is not None else None,
        int(update is not None and update.dtype == torch.bfloat16),
        total.data_ptr(),
        *(p.data_ptr() for p in params),
        out.data_ptr(),
        int(rounded),
        x.numel() // width,
        width,
        eps,
        torch.get_num_threads(),
    )
    return total, out


def rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, norm: tuple | None = None
) -> torch.Tensor:
    """x (rows, heads, d) float32 on the CPU, or (norm_rotary) a product's bfloat16 outputs, any
    row and head strides, d contiguous, rotated by cos/sin (rows, rot) float32, contiguous, rot <=
    d and even (the rest of each head passes through), each head normalised first where `norm`,
    (weight: d float32 values, eps), gives an RMSNorm (d at most MAX_HEAD then); a new contiguous
    float32 tensor. See pointwise.c."""
    library, reason = load()
    if library is None:
        raise RuntimeError(reason)
    rows, heads, d = x.shape
    out = torch.empty(rows, heads, d)
    strided = (x.data_ptr(), x.stride(0), x.stride(1))
    shape = (out.data_ptr(), rows, heads, d)
    rotation = (cos.data_ptr(), sin.data_ptr(), cos.shape[-1])
    threads = torch.get_num_threads()
    if norm is None and x.dtype == torch.float32:
        library.rotary(*strided, *shape, *rotation, threads)
        return out
    if d > MAX_HEAD:
        raise ValueError(f"norm_rotary holds heads of {MAX_HEAD} values at most, not {d}")
    weight, eps = (norm[0].data_ptr(), norm[1]) if norm is not None else (None, 0.0)
    bf16 = int(x.dtype == torch.bfloat16)
    library.norm_rotary(strided[0], bf16, *strided[1:], *shape, weight, eps, *rotation, threads)
    return out


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor:
    """decode_layer.c's attention of a decode step: each row's k and v [B, kv_heads, d] (float32,
    contiguous) written at column positions[r] of cache row slots[r] (k_cache, v_cache [rows,
    kv_heads, columns, d], float32 or bfloat16, contiguous; slots and positions int64), then its
    query heads q [B, heads, d] against the row's first positions[r] + 1 columns -> [B, heads,
    d]."""
    library, reason = load()
    if library is None:
        raise RuntimeError(reason)
    (rows, heads, d), kv_heads = q.shape, k.shape[1]
    out = torch.empty(rows, heads, d)
    tensors = (q, k, v, k_cache, v_cache)
    kv_bf16 = int(k_cache.dtype == torch.bfloat16)
    status = library.decode_attention(
        *(t.data_ptr() for t in tensors),
        k_cache.shape[2],
        kv_bf16,
        slots.data_ptr(),
        positions.data_ptr(),
        rows,
        heads,
        kv_heads,
        d,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    if status:
        raise MemoryError("decode_layer.c could not allocate the attention's scores")
    return out


def delta_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor | None:
    """delta_rule.c: the gated delta rule's decode step, the rows `slots` (int64) of states [rows,
    heads, dk, dv] (float32, contiguous) advanced in place by q, k [B, heads, dk], v [B, heads,
    dv], decay and beta [B, heads] (float32, contiguous) -> out [B, heads, dv]; None where dv is
    not the kernel's."""
    library, reason = load()
    if library is None:
        raise RuntimeError(reason)
    rows, heads, dk = q.shape
    dv = v.shape[-1]
    out = torch.empty(rows, heads, dv)
    tensors = (q, k, v, decay, beta, states, slots, out)
    pointers = [t.data_ptr() for t in tensors]
    status = library.delta_step(*pointers, rows, heads, dk, dv, torch.get_num_threads())
    return None if status else out


def silu_times(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate <- silu(gate) * up, in place (both float32, contiguous, of one shape, on the CPU);
    returns gate."""
    library, reason = load()
    if library is None:
        raise RuntimeError(reason)
    library.silu_times(gate.data_ptr(), up.data_ptr(), gate.numel(), torch.get_num_threads())
    return gate


def silu_times_rounded(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in float32 from bfloat16 gate and up (contiguous, of one shape, on the
    CPU), rounded to bfloat16: a new tensor."""
    library, reason = load()
    if library is None:
        raise RuntimeError(reason)
    out = torch.empty_like(gate)
    library.silu_times_rounded(
        gate.data_ptr(), up.data_ptr(), out.data_ptr(), gate.numel(), torch.get_num_threads()
    )
    return out


def widen_outputs(
    products: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str | None,
    rounded: bool = False,
) -> torch.Tensor:
    """activation(products (..., cols) bfloat16, contiguous, widened to float32 + bias (float32,
    contiguous, or None)), one pass (pointwise.c); activation one of ACTIVATIONS. `rounded`:
    the result in bfloat16, each value rounded as torch rounds float32."""
    library, reason = load()
    if library is None:
        raise RuntimeError(reason)
    y = torch.empty(products.shape, dtype=torch.bfloat16 if rounded else torch.float32)
    cols = products.shape[-1]
    library.widen_outputs(
        products.data_ptr(),
        bias.data_ptr() if bias is not None else None,
        y.data_ptr(),
        products.numel() // cols,
        cols,
        ACTIVATIONS[activation],
        int(rounded),
        torch.get_num_threads(),
    )
    return y


def int4_dequantize(weight, group: int, start: int, stop: int, block: int) -> torch.Tensor:
    """Output channels [start, stop) (multiples of `block`, the channels a block of the packing
    holds: 64 or 32) of an Int4Weight, its scales and zeros by group, as bfloat16 [in, stop -
    start] (int4_tiles.c)."""
    library, reason = load()
    if library is None:
        raise RuntimeError(reason)
    if weight.layout != "torch":
        raise ValueError(f"int4_dequantize reads torch's int4 layout, not {weight.layout}")
    out_features, inner = weight.shape
    dest = torch.empty(inner, stop - start, dtype=torch.bfloat16)
    library.int4_dequantize(
        weight.packed.data_ptr(),
        weight.scales_zeros.data_ptr(),
        inner,
        out_features,
        group,
        block,
        start // block,
        (stop - start) // block,
        dest.data_ptr(),
        torch.get_num_threads(),
    )
    return dest


def decode_scratch(layer: DecodeLayer, rows: int, context: int) -> torch.Tensor:
    """The floats decode_layer.c works in for `rows` rows reaching `context` columns (one buffer
    for every layer of a step): its float32 rows, then quantized rows' scales, int4's group
    sums and the levels (or the rows in pairs' order), then each row's attention scores."""
    per_row = 2 * layer.hidden + 2 * (layer.heads + layer.kv_heads) * layer.d
    widest = max(layer.hidden, layer.heads * layer.d, layer.intermediate)
    # a scale a row (int8) or a group of 32 (int4), int4's sums alike, then a float a value (a
    # byte for levels; bfloat16 weights' rows in pairs' order)
    levels = 2 * rows * (widest // 32 + 1) + rows * widest
    return torch.empty(
        rows * (per_row + 2 * layer.intermediate) + levels + rows * layer.heads * context
    )


def decode_layer(
    layer: DecodeLayer,
    x: torch.Tensor,
    kv: tuple[torch.Tensor, torch.Tensor],
    slots: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    scratch: torch.Tensor,
) -> None:
    """The layer's output for one token a row into x (rows x hidden, contiguous, float32), row
    r's key and value written at column positions[r] of cache row slots[r] (kv: [cache rows,
    kv_heads, columns, d], contiguous, float32 or bfloat16) and attended over positions[r] + 1
    columns; slots and positions int64 on the CPU, their values checked by the caller; cos/sin:
    d values a row; scratch: decode_scratch's for these rows and positions. See decode_layer.c."""
    library, reason = load()
    if library is None:
        raise RuntimeError(reason)
    k, v = kv
    if k.dtype not in (torch.float32, torch.bfloat16) or v.dtype != k.dtype:
        raise ValueError(f"decode_layer: a float32 or bfloat16 cache, not {k.dtype} and {v.dtype}")
    library.decode_layer(
        ctypes.byref(layer),
        x.data_ptr(),
        x.shape[0],
        k.data_ptr(),
        v.data_ptr(),
        k.shape[2],
        k.dtype == torch.bfloat16,
        slots.data_ptr(),
        positions.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        scratch.data_ptr(),
        torch.get_num_threads(),
    )


# int8 on the AMX build: to INT8_VNNI_ROWS rows on the vector units' int8 dot products, which read
# the weights faster there (bench/int8_kernel.py), more on the tiles; both sum the same integers
INT8_VNNI_ROWS = 8


def int8_linear(
    x: torch.Tensor, weight, vnni_rows: int = INT8_VNNI_ROWS, activation: str | None = None
) -> torch.Tensor:
    """activation(x (rows, in) float32, contiguous, @ an Int8Weight (models/layers/quantized.py)
    + its bias), each row quantized to 7 bits with its own scale on the way; float32 (rows,
    padded out) out, the activation (one of ACTIVATIONS) applied as each output is stored. On
    the AMX build, more than `vnni_rows` rows on the tiles."""
    levels, scale = int8_rows(x, weight.values.shape[1])
    return int8_products(levels, scale, weight, vnni_rows, activation)


def int8_rows(
    x: torch.Tensor, padded_in: int, wide: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """x (rows, in) float32, contiguous, as int8_linear.c takes it: each row's levels (7 bits,
    offset by 64, or with `wide` int16 levels of 14 bits; `padded_in` wide) and its scale."""
    library, reason = load()
    if library is None:
        raise RuntimeError(reason)
    rows, width = x.shape
    levels = torch.empty(rows, padded_in, dtype=torch.int16 if wide else torch.uint8)
    scale = torch.empty(rows)
    quantize = library.quantize_rows_wide if wide else library.quantize_rows
    threads = torch.get_num_threads()
    quantize(x.data_ptr(), rows, width, levels.data_ptr(), padded_in, scale.data_ptr(), threads)
    return levels, scale


def int8_products(
    levels: torch.Tensor,
    scale: torch.Tensor,
    weight,
    vnni_rows: int = INT8_VNNI_ROWS,
    activation: str | None = None,
) -> torch.Tensor:
    """int8_linear.c's products of rows already quantized (int8_rows) with an Int8Weight."""
    library, reason = load()
    if library is None:
        raise RuntimeError(reason)
    rows = levels.shape[0]
    padded_out, padded_in = weight.values.shape
    threads = torch.get_num_threads()
    out = torch.empty(rows, padded_out)
    library.int8_linear(
        levels.data_ptr(),
        scale.data_ptr(),
        weight.values.data_ptr(),
        weight.sums.data_ptr(),
        weight.scale.data_ptr(),
        weight.bias.data_ptr(),
        out.data_ptr(),
        rows,
        padded_out,
        padded_in,
        vnni_rows,
        ACTIVATIONS[activation],
        threads,
    )
    return out


def int8_wide_linear(x: torch.Tensor, weight) -> torch.Tensor:
    """x (rows, in) float32, contiguous, @ an Int8Weight + its bias, each row quantized to 14 bits
    (int16 levels) with its own scale: int8_linear.c's logits' products; float32 (rows, padded
    out) out."""
    padded_out, padded_in = weight.values.shape
    levels, scale = int8_rows(x, padded_in, wide=True)  # loads the library, or says why not
    out = torch.empty(x.shape[0], padded_out)
    load()[0].int8_linear_wide(
        levels.data_ptr(), scale.data_ptr(), weight.values.data_ptr(), weight.scale.data_ptr(),
        weight.bias.data_ptr(), out.data_ptr(), x.shape[0], padded_out, padded_in,
        torch.get_num_threads(),
    )  # fmt: skip
    return out


def quantize_weights(
    weight: torch.Tensor, column_scale: torch.Tensor | None, padded: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """int8_weights.c: weight (out, in) bfloat16 or float32, contiguous, its columns times
    `column_scale` (float32, or None) -> int8 values in int8_linear.c's layout (`padded` sides),
    each channel's scale and each channel's sum, as weights/int8.py's quantize_int8 computes
    them."""
    library, reason = load()
    if library is None:
        raise RuntimeError(reason)
    (rows, width), (n, k) = weight.shape, padded
    values = torch.empty(n, k, dtype=torch.int8)
    scale, sums = torch.empty(n), torch.empty(n, dtype=torch.int32)
    library.quantize_weights(
        weight.data_ptr(),
        int(weight.dtype == torch.bfloat16),
        None if column_scale is None else column_scale.data_ptr(),
        rows,
        width,
        values.data_ptr(),
        scale.data_ptr(),
        sums.data_ptr(),
        n,
        k,
        torch.get_num_threads(),
    )
    return values, scale, sums
