"""Progress for `mmcli caption`: Rich bar on a terminal, plain lines otherwise, nothing with --quiet."""

from __future__ import annotations

import sys
import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.progress import Progress as RichProgress
from rich.table import Table


class Progress:
    def __init__(self, total: int, quiet: bool = False):
        self.total, self.quiet = total, quiet
        self.done = self.failed = self.tokens = 0
        self.started = time.perf_counter()
        self.console = Console(stderr=True)
        self.bar = None
        if not quiet and self.console.is_terminal:
            self.bar = RichProgress(TextColumn("captioning"), BarColumn(), MofNCompleteColumn(),
                                    TextColumn("{task.fields[rate]}"), TextColumn("{task.fields[failed]}"),
                                    TimeElapsedColumn(), TimeRemainingColumn(), console=self.console)
            self.task = self.bar.add_task("caption", total=total, rate="", failed="")
            self.bar.start()

    def _rates(self) -> tuple[float, float]:
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        return self.done / elapsed, self.tokens / elapsed

    def update(self, record: dict) -> None:
        ok = record["status"] == "ok"
        self.done += 1
        self.failed += not ok
        self.tokens += record.get("num_output_tokens") or 0
        images_s, tokens_s = self._rates()
        if self.bar is not None:
            self.bar.update(self.task, completed=self.done, rate=f"{images_s:.2f} img/s {tokens_s:.1f} tok/s",
                            failed=f"{self.failed} failed" if self.failed else "")
        elif not self.quiet:
            status = "ok" if ok else f"error: {record['error']['message']}"
            print(f"mmcli: [{self.done}/{self.total}] {record['key']}: {status} ({images_s:.2f} images/s)",
                  file=sys.stderr, flush=True)

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None

    def finish(self, interrupted: bool = False) -> None:
        self.stop()
        if self.quiet:
            return
        images_s, tokens_s = self._rates()
        table = Table(title="interrupted: finished items are saved" if interrupted else "done")
        for col in ("images", "ok", "failed", "not done", "seconds", "images/s", "tokens/s"):
            table.add_column(col, justify="right")
        table.add_row(str(self.done), str(self.done - self.failed), str(self.failed), str(self.total - self.done),
                      f"{time.perf_counter() - self.started:.1f}", f"{images_s:.2f}", f"{tokens_s:.1f}")
        self.console.print(table)
