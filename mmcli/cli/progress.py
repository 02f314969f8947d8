"""What `mmcli caption` shows while it works: the loading phase, the progress bar and the
summary.

On a terminal: a Rich status line while the model loads, then the bar. Not on a terminal (cron, a
log file): one plain line per phase and per item. With --quiet: nothing but the errors that stop
a run."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.progress import Progress as RichProgress
from rich.table import Table

SHOWN_FAILURES = 10


class Progress:
    def __init__(
        self,
        total: int = 0,
        quiet: bool = False,
        console: Console | None = None,
        work: tuple[str, str] = ("captioning", "images"),
        redo: str = "fix the files, then rerun with --retry-errors to redo them",
    ):
        """`work`: what the run does and what it counts (`batch`: answering requests); `redo`:
        how to redo what failed."""
        self.total, self.quiet = total, quiet
        self.verb, self.unit = work
        self.redo = redo
        self.done = self.tokens = 0
        self.failures: list[tuple[str, str]] = []  # (key, one-line cause)
        self.load_seconds = 0.0
        self.started = time.perf_counter()
        self.console = console or Console(stderr=True)
        self.bar: RichProgress | None = None

    @property
    def failed(self) -> int:
        return len(self.failures)

    @property
    def live(self) -> bool:
        return not self.quiet and self.console.is_terminal

    def say(self, line: str | None) -> None:
        """One line on stderr (none with --quiet, or without a line)."""
        if line and not self.quiet:
            print(f"mmcli: {line}", file=self.console.file, flush=True)

    def note(self, line: str | None) -> None:
        """A line on stderr even with --quiet (what the compile cache holds and misses)."""
        if line:
            print(f"mmcli: {line}", file=self.console.file, flush=True)

    @contextlib.contextmanager
    def status(self, what: str) -> Iterator[None]:
        """A phase before loading (scanning the inputs): a status line on a terminal."""
        if self.quiet:
            yield
            return
        with status_line(self.console, what):
            yield

    @contextlib.contextmanager
    def loading(self, what: str) -> Iterator[dict]:
        """The load phase: a status line with elapsed time on a terminal, else a line before and
        after. The caller may name the kernels chosen at load (`loaded["kernels"]`)."""
        started, loaded = time.perf_counter(), {}
        if self.live:
            with status_line(self.console, f"loading {what}"):
                yield loaded
        else:
            self.say(f"loading {what}")
            yield loaded
        self.load_seconds = time.perf_counter() - started
        kernels = f" ({loaded['kernels']})" if loaded.get("kernels") else ""
        self.say(
            f"loaded in {self.load_seconds:.1f} s{kernels}; {self.verb} {self.total} {self.unit}"
        )
        self.start()

    def start(self) -> None:
        """Labeling starts now: its rate counts from here, not from the start of the load."""
        self.started = time.perf_counter()
        if self.live and self.bar is None:
            self.bar = RichProgress(
                TextColumn(self.verb),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[rate]}"),
                TextColumn("{task.fields[failed]}"),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                console=self.console,
            )
            self.task = self.bar.add_task("caption", total=self.total, rate="", failed="")
            self.bar.start()

    def _rates(self) -> tuple[float, float, float]:
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        return elapsed, self.done / elapsed, self.tokens / elapsed

    def update(self, record: dict) -> None:
        ok = record["status"] == "ok"
        self.done += 1
        if not ok:
            cause = " ".join(str(record["error"]["message"]).split())
            where, _, rest = cause.partition(": ")
            self.failures.append(
                (record["key"], rest if rest and where.endswith(record["key"]) else cause)
            )
        self.tokens += record.get("num_output_tokens") or 0
        _, images_s, tokens_s = self._rates()
        if self.bar is not None:
            self.bar.update(
                self.task,
                completed=self.done,
                rate=f"{images_s:.2f} {self.unit}/s {tokens_s:.1f} tok/s",
                failed=f"{self.failed} failed" if self.failed else "",
            )
        else:
            status = "ok" if ok else f"error: {self.failures[-1][1]}"
            rate = f"{images_s:.2f} {self.unit}/s"
            self.say(f"[{self.done}/{self.total}] {record['key']}: {status} ({rate})")

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None

    def finish(self, interrupted: bool = False) -> None:
        self.stop()
        if self.quiet:
            return
        elapsed, images_s, tokens_s = self._rates()
        table = Table(title="interrupted: finished items are saved" if interrupted else "done")
        for col in (
            self.unit,
            "ok",
            "failed",
            "not done",
            "load s",
            "labeling s",
            f"{self.unit}/s",
            "tokens/s",
        ):
            table.add_column(col, justify="right")
        table.add_row(
            str(self.done),
            str(self.done - self.failed),
            str(self.failed),
            str(self.total - self.done),
            f"{self.load_seconds:.1f}",
            f"{elapsed:.1f}",
            f"{images_s:.2f}",
            f"{tokens_s:.1f}",
        )
        self.console.print(table)
        for line in failure_lines(self.failures, self.redo):
            self.console.print(line, markup=False, highlight=False, soft_wrap=True)


@contextlib.contextmanager
def status_line(console: Console, what: str) -> Iterator[None]:
    """A spinner, `what` and the elapsed time on one line of a terminal while the block runs
    (gone after)."""
    if not console.is_terminal:
        yield
        return
    status = RichProgress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    )
    status.add_task(what, total=None)
    with status:
        yield


def failure_lines(
    failures: list[tuple[str, str]], redo: str, shown: int = SHOWN_FAILURES
) -> list[str]:
    """The failed items by name with their causes (the first `shown`), and how to redo them."""
    if not failures:
        return []
    lines = [f"failed: {key}: {cause}" for key, cause in failures[:shown]]
    if len(failures) > shown:
        lines.append(f"and {len(failures) - shown} more (their error records say why)")
    lines.append(f"{len(failures)} failed; {redo}")
    return lines
