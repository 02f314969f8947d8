"""The CPU's matrix and vector units, as the kernel plan and the precision choose from them
(torch-free): read once from /proc/cpuinfo (x86's `flags`, aarch64's `Features`).

MMCLI_CPU_FEATURES=amx_bf16,amx_int8 (a comma list; `none` for none) replaces what the CPU reports,
so that tests and benches can force each path: the plan then chooses as on such a CPU. The
library's kernels it then calls (oneDNN's bfloat16 and int8) run on any CPU, slowly without the
units; our C kernels are built from the CPU's real flags, never from the override."""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass
from pathlib import Path

# the units the plan knows, as Linux names them
X86_UNITS = ("amx_bf16", "amx_int8", "avx512_bf16", "avx512_vnni", "avx512f", "avx2", "fma")
ARM_UNITS = ("bf16", "i8mm", "sve", "asimddp")
OVERRIDE = "MMCLI_CPU_FEATURES"


@dataclass(frozen=True)
class CpuFeatures:
    arch: str  # x86_64, aarch64, ...
    model: str  # the CPU's model name
    cores: int  # the CPUs this process may run on
    units: frozenset[str]  # of X86_UNITS / ARM_UNITS
    overridden: bool = False  # units from MMCLI_CPU_FEATURES, not from the CPU

    def bf16_matrix(self) -> bool:
        """Whether the CPU multiplies bfloat16 in hardware: AMX-BF16, AVX-512 BF16 (two products
        a float32 lane) or Arm's BF16 (BFMMLA)."""
        return bool(self.units & {"amx_bf16", "avx512_bf16", "bf16"})

    def int8_matrix(self) -> bool:
        """Whether int8 products run on a matrix engine (AMX-INT8, Arm's i8mm), beyond the vector
        units' dot products (VNNI)."""
        return bool(self.units & {"amx_int8", "i8mm"})

    def engine(self) -> str:
        """The unit the plan's bfloat16 GEMMs run on, in words."""
        for unit, words in (
            ("amx_bf16", "AMX"),
            ("avx512_bf16", "AVX-512 BF16"),
            ("bf16", "BFMMLA"),
        ):
            if unit in self.units:
                return words
        return "vector FMA"

    def key(self, torch_version: str) -> str:
        """What a measurement made on this machine is valid for."""
        units = ",".join(sorted(self.units))
        return f"{self.model}|{self.cores} cores|{units}|torch {torch_version}"

    def describe(self) -> str:
        source = f" (from {OVERRIDE})" if self.overridden else ""
        units = ", ".join(sorted(self.units)) or "none of the known units"
        return f"{self.model}, {self.cores} cores, {self.arch}: {units}{source}"


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo ({} where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break
            continue
        name, _, value = line.partition(":")
        fields.setdefault(name.strip(), value.strip())
    return fields


def reported_units(info: dict[str, str]) -> frozenset[str]:
    """The known units among the flags (x86) or features (aarch64) a /proc/cpuinfo lists."""
    flags = set((info.get("flags") or info.get("Features") or "").split())
    return frozenset(flags & {*X86_UNITS, *ARM_UNITS})


def parse_override(value: str) -> frozenset[str]:
    """MMCLI_CPU_FEATURES's units; a name the plan does not know is an error naming it."""
    names = {name.strip() for name in value.split(",") if name.strip()} - {"none"}
    unknown = names - {*X86_UNITS, *ARM_UNITS}
    if unknown:
        known = ", ".join([*X86_UNITS, *ARM_UNITS])
        raise ValueError(f"{OVERRIDE}: unknown unit(s) {', '.join(sorted(unknown))} ({known})")
    return frozenset(names)


def detect() -> CpuFeatures:
    """This CPU as the plan sees it: its units, or MMCLI_CPU_FEATURES's where that is set."""
    return _detect(os.environ.get(OVERRIDE))


@functools.cache
def _detect(override: str | None) -> CpuFeatures:
    info = _cpuinfo()
    model = info.get("model name") or info.get("CPU part") or platform.processor() or "unknown"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    units = parse_override(override) if override is not None else reported_units(info)
    return CpuFeatures(platform.machine(), model, cores or 1, units, override is not None)


def real_units() -> frozenset[str]:
    """What the CPU itself reports, whatever the override (what our C kernels may be built
    for)."""
    return reported_units(_cpuinfo())


def exact_int8() -> bool:
    """Whether oneDNN's int8 GEMM is exact on this CPU itself, whatever the override: on VNNI or
    AMX-INT8; elsewhere it multiplies in pairs whose 16-bit sums saturate (15% of the largest
    output off on a 2048-deep product of our 7-bit activations)."""
    return bool(real_units() & {"avx512_vnni", "amx_int8"})
