"""The machine a run's kernels are chosen for: the CPU's units (as MMCLI_CPU_FEATURES may mask
them), our C kernels' build here or why none loads, and, where two kernels are close on these
units, the row count above which the library's wins, measured once per machine and cached
(kernels/measure.py). `here()` is the one place the environment's overrides are read; the kernel
plan is a function of a run's shape and a Machine, so tests build one by hand.

MMCLI_CPU_PREFER=library or ours stands in for every measurement (tests and benches force each
path so). Units that MMCLI_CPU_FEATURES adds to the CPU's own are not measured (the library
would emulate them): ours is taken there."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from mmcli.kernels.cpu_features import OVERRIDE, CpuFeatures, real_units

PREFER = "MMCLI_CPU_PREFER"
# what the environment may say about the kernels: read by here(), one Machine for each
ENVIRONMENT = (OVERRIDE, "MMCLI_CPU_KERNEL", "CC", PREFER)
TILE_UNITS = frozenset({"amx_bf16", "amx_int8"})
BF16_DOT_BUILD = "AVX-512 BF16"  # the build with bf16_dot.c and no tiles


@dataclass(frozen=True)
class Crossover:
    """Where the library's kernel of a comparison wins over ours."""

    above: int | None  # rows above which it wins (0: at every count; None: at none)
    why: str


@dataclass(frozen=True)
class Machine:
    cpu: CpuFeatures
    build: str = ""  # our C kernels' build ("AMX", "AVX-512 BF16", "AVX-512 VNNI", "AVX2") or ""
    unavailable: str = ""  # why no build loads (where none does)
    crossovers: Mapping[str, Crossover] = field(default_factory=dict)
    # the floors, where asked for (`mmcli doctor`, the benches): the read bandwidth a decode step
    # sees (GB/s) and each unit's peak (G(FL)OP/s: float32, bfloat16, int8)
    read_gb_s: float | None = None
    peaks: Mapping[str, float] = field(default_factory=dict)
    libraries: frozenset[str] = frozenset()  # optional kernel libraries installed: fla
    # our build's int4_vnni.c reads torch's int4 layout here (VNNI and VBMI's 64 channels a
    # block, AVX2's 32)
    int4_vnni: bool = False
    # and widens a prompt's rows to int8 (VBMI's build; AVX2's leaves them to torch's int4)
    int4_widened: bool = False
    # torch's int4 CPU layout in this process: output channels a block (weight_forms.int4_block;
    # the tiles' dequantizer and amx.c read 64), None for one the dequantizer cannot read
    int4_block: int | None = 64
    # and reads int4's scales and zeros by block too (its AVX2 half; weight_forms.Int4Weight)
    int4_blocks: bool = False
    exact_int8: bool = True  # oneDNN's int8 GEMM is exact here (cpu_features.exact_int8)

    def key(self) -> str:
        """What this machine's measurements are cached under."""
        from mmcli.kernels import measure

        return measure.machine_key(self.cpu, self.build)

    def tiles(self) -> bool:
        """Whether amx.c's kernels run here: the units (as the machine sees them) include AMX
        and our AMX build is loaded."""
        return TILE_UNITS <= self.cpu.units and self.build == "AMX"

    def bf16_pairs(self) -> bool:
        """Whether our build's AVX-512 BF16 dot products run here (bf16_dot.c, attention.c's
        pairs): the units include AVX-512 BF16 and the build was made for them."""
        from mmcli.kernels import cpu

        return "avx512_bf16" in self.cpu.units and self.build in cpu.BF16_DOT_BUILDS

    def bf16_dot(self) -> bool:
        """Whether bf16_dot.c's dot products make the bfloat16 products of few rows here: the
        units include AVX-512 BF16 and our BF16 build (no tiles) is loaded."""
        return "avx512_bf16" in self.cpu.units and self.build == BF16_DOT_BUILD

    def crossover(self, name: str) -> Crossover:
        if name not in self.crossovers:
            measured = ", ".join(sorted(self.crossovers)) or "nothing"
            raise KeyError(f"{name} is not measured on this machine (it has {measured})")
        return self.crossovers[name]

    def describe_build(self) -> str:
        return self.build or f"none ({self.unavailable})"


# the comparisons that time oneDNN's int8 GEMM: only where its sums are exact (exact_int8)
ONEDNN_INT8_COMPARISONS = ("int8_prefill", "int8_vision")


def comparisons(
    cpu: CpuFeatures,
    build: str,
    int4_vnni: bool = False,
    int4_block: int | None = 64,
    exact_int8: bool = True,
) -> tuple[str, ...]:
    """The measured comparisons the plan can consult on these units and this build (`int4_vnni`:
    it has int4_vnni.c; `int4_block`: torch's int4 layout here; `exact_int8`: oneDNN's int8 GEMM
    may be taken, cpu_features.exact_int8); the units decide the rest (AMX-BF16 above the
    few-rows kernel, the int8 matrix engines, amx.c's tiles)."""
    names = []
    if cpu.bf16_matrix():  # bfloat16 products are chosen only where the CPU has them
        names += [] if "amx_bf16" in cpu.units else ["bf16_gemm"]
        names += ["attention"]
    if exact_int8 and not cpu.int8_matrix():  # elsewhere it would saturate: never taken
        names += ONEDNN_INT8_COMPARISONS
    if TILE_UNITS <= cpu.units and build == "AMX":
        names += ["int8_step_rows"]
    amx_int4 = TILE_UNITS <= cpu.units and build == "AMX" and int4_block == 64
    if int4_block is not None and not amx_int4:
        names += ["int4_tiles"]
    if int4_block is not None and int4_vnni:  # a decode step's fewest rows, AMX's too
        names += ["int4_fewest_rows"]
    if amx_int4 and int4_vnni:  # and its other rows: on the vector units or the tiles
        names += ["int4_step_rows"]
    return tuple(names)


def crossover_of(result: dict) -> Crossover:
    """A measurement's crossover, with its rates in words."""
    from mmcli.kernels import measure

    ours, library = result["kernels"]
    rates = ", ".join(f"{a:.0f} vs {b:.0f} at {rows}" for rows, (a, b) in result["rates"].items())
    why = f"measured here: {ours} vs {library}, G(FL)OP/s by rows: {rates}"
    return Crossover(measure.crossover(result["rates"]), why)


def _crossover(name: str, cpu: CpuFeatures, build: str, unavailable: str) -> Crossover:
    prefer = os.environ.get(PREFER)
    if prefer in ("library", "ours"):
        return Crossover(0 if prefer == "library" else None, f"{PREFER}={prefer}")
    if name != "int4_tiles" and not build:  # the int4 tiles are the library's and torch's
        return Crossover(0, f"ours not built here ({unavailable})")
    emulated = cpu.units - real_units()
    if emulated:  # a rate measured on units the CPU emulates says nothing about them
        return Crossover(None, f"nothing measured: {', '.join(sorted(emulated))} not on this CPU")
    from mmcli.kernels import measure

    return crossover_of(measure.measured(name, measure.machine_key(cpu, build)))


@functools.cache
def _made(environment: tuple[str | None, ...], floors: bool) -> Machine:
    from mmcli.kernels import cpu, cpu_features, measure, weight_forms

    units = cpu_features.detect()
    library, unavailable = cpu.load()
    build = library.build if library is not None else ""
    int4_block = weight_forms.int4_block()
    int4_vnni = bool(library is not None and library.int4_vnni)
    int4_widened = bool(int4_vnni and library.int4_widened)
    exact_int8 = cpu_features.exact_int8()
    crossovers = {
        name: _crossover(name, units, build, unavailable)
        for name in comparisons(units, build, int4_vnni, int4_block, exact_int8)
    }
    machine = Machine(
        units,
        build,
        unavailable,
        crossovers,
        libraries=installed_libraries(),
        int4_vnni=int4_vnni,
        int4_widened=int4_widened,
        int4_block=int4_block,
        int4_blocks=bool(int4_vnni and library.int4_blocks),
        exact_int8=exact_int8,
    )
    if not floors:
        return machine
    read = measure.measured("floors", machine.key())["read_gb_s"]
    return dataclasses.replace(
        machine, read_gb_s=read, peaks=measure.measured("peaks", machine.key())
    )


def here(floors: bool = False) -> Machine:
    """This machine under the environment's overrides: made once per process (per distinct
    overrides), measuring what it has not measured before (a few seconds, once per machine);
    with its floors where asked."""
    return _made(tuple(os.environ.get(name) for name in ENVIRONMENT), floors)


def for_device(device: str) -> Machine:
    """The machine a run on `device` is planned for: here() on the CPU; elsewhere the host's
    units and libraries, none of our kernels built and nothing measured (the plan takes no CPU
    kernel there)."""
    if device == "cpu":
        return here()
    from mmcli.kernels import cpu_features

    return Machine(cpu_features.detect(), "", "not on the CPU", libraries=installed_libraries())


def installed_libraries() -> frozenset[str]:
    """The optional kernel libraries importable here (found, not imported)."""
    return frozenset(name for name in ("fla",) if importlib.util.find_spec(name) is not None)


def measure_again() -> Machine:
    """This machine measured anew (`mmcli doctor --measure`): every comparison it consults and
    its floors, the cache replaced."""
    from mmcli.kernels import measure

    machine = here()
    ours = [name for name in machine.crossovers if machine.build or name == "int4_tiles"]
    for name in (*ours, "floors", "peaks"):
        measure.measured(name, machine.key(), again=True)
    _made.cache_clear()
    return here(floors=True)
