"""`mmcli doctor`: what this machine computes with. The CPU's units, the library's peak on each
(float32 FMA, bfloat16 and int8 on the matrix engine where there is one), the kernel plan a run
of the settings gets, and each measured comparison's kernels against the peak of the unit they
run on."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from mmcli.api.loader import Run, choose_kernels, resolve_run
from mmcli.config import Config
from mmcli.kernels import measure
from mmcli.kernels.machine import ONEDNN_INT8_COMPARISONS, Machine, here, measure_again


def plan_table(run: Run) -> Table:
    plan = choose_kernels(run, run.model_config)
    shown = str(run.path) if run.path else f"{run.config.model} (not on disk: a dense model's plan)"
    precision = ", ".join(f"{k} {v}" for k, v in run.precision.record().items())
    table = Table(title=f"kernel plan: {shown}; {precision}", title_justify="left")
    for column in ("work", "kernel", "why"):
        table.add_column(column, overflow="fold")
    for work, choice in plan.choices().items():
        table.add_row(work, choice.kernel, choice.why)
    table.add_row("C kernels", plan.build, "")
    return table


def _both_here(name: str, machine: Machine) -> bool:
    """Whether both kernels of the comparison `name` run here (else there is nothing to time)."""
    if name in ("peaks", "floors"):
        return False
    if name == "int4_tiles":  # the library's tiles and torch's kernel, whatever we built
        return machine.int4_block is not None
    if name == "int4_fewest_rows":
        return machine.int4_vnni
    if name in ("int8_step_rows", "int4_step_rows"):  # the vector units against the tiles
        return machine.tiles() and (name == "int8_step_rows" or machine.int4_vnni)
    if name in ONEDNN_INT8_COMPARISONS:
        return bool(machine.build) and machine.exact_int8
    return bool(machine.build)


def rates_table(machine: Machine, again: bool) -> Table:
    table = Table(title="measured kernels, against their unit's peak", title_justify="left")
    for column in ("comparison", "rows", "kernel", "G(FL)OP/s", "of the peak"):
        table.add_column(column, justify="right" if column in ("rows", "G(FL)OP/s") else "left")
    for name in filter(lambda name: _both_here(name, machine), measure.COMPARISONS):
        result = measure.measured(name, machine.key(), again)
        for rows, pair in result["rates"].items():
            for kernel, unit, rate in zip(result["kernels"], result["units"], pair):
                share = f"{rate / machine.peaks[unit]:.0%} of {unit}"
                table.add_row(name, str(rows), kernel, f"{rate:.0f}", share)
    return table


def doctor(cfg: Config, again: bool) -> None:
    console = Console()
    machine = measure_again() if again else here(floors=True)
    console.print(f"CPU: {machine.cpu.describe()}")
    console.print(
        f"bfloat16 products: {machine.cpu.engine()}; C kernels: {machine.describe_build()}"
    )
    peaks = ", ".join(f"{unit} {rate:.0f} G(FL)OP/s" for unit, rate in machine.peaks.items())
    console.print(
        f"floors: read bandwidth {machine.read_gb_s:.1f} GB/s; peaks: {peaks}"
        f" (measured once, cached in {measure.store_path()})"
    )
    console.print(plan_table(resolve_run(cfg)))
    console.print(rates_table(machine, again))
