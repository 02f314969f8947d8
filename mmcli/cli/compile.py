"""`mmcli compile --buckets`: load the model, compile each bucket unless cached, print a table."""

from __future__ import annotations

import time
from functools import partial

from rich.console import Console
from rich.table import Table

from mmcli.config import Config


def compile_buckets(cfg: Config, bucket_list: str | None) -> None:
    """Load the model, compile each configured bucket (or those listed) unless cached, and print
    the table."""
    from mmcli.api.labeler import Labeler
    from mmcli.compiled.buckets import parse_buckets
    from mmcli.engine.warmup import run_bucket

    started = time.perf_counter()
    labeler = Labeler.from_pretrained(config=cfg)
    graphs = labeler.graphs
    todo = parse_buckets(bucket_list, graphs.buckets) if bucket_list else graphs.buckets
    console = Console(width=100, stderr=False)
    table = Table(title=f"{graphs.backend} buckets in {graphs.cache_dir}")
    for col in ("component", "bucket shape", "seconds", "status"):
        table.add_column(col, justify="right" if col == "seconds" else "left")
    counts: dict[str, int] = {}
    for bucket in todo:
        status, seconds = graphs.compile_bucket(bucket, partial(run_bucket, labeler.runner))
        counts[status.split()[0]] = counts.get(status.split()[0], 0) + 1
        table.add_row(bucket.component, "x".join(map(str, bucket.shape)), f"{seconds:.1f}", status)
    console.print(table)
    summary = ", ".join(f"{n} {status}" for status, n in counts.items())
    console.print(f"{len(todo)} buckets ({summary}) in {time.perf_counter() - started:.1f} s")


def prepare_weights_only(cfg: Config) -> None:
    """The eager backend has no graphs to compile; with `quantize: int8` or `int4` the warm-up
    is the prepared weights (weights/prepared.py): load once, and say where they are."""
    from mmcli.api.labeler import Labeler

    started = time.perf_counter()
    labeler = Labeler.from_pretrained(config=cfg)
    line = f"eager backend, nothing to compile; {labeler.kernels}"
    line += f" ({time.perf_counter() - started:.1f} s)"
    # the warm-up is done when the file being written is whole
    outcome = labeler.prepared_weights_report()
    if outcome and outcome not in line:
        line += f"; {outcome} ({time.perf_counter() - started:.1f} s)"
    Console(width=100).print(line)
