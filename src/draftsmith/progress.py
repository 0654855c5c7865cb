"""Progress for long work: a rich bar on a terminal, a plain line every few seconds in a log file.

Both go to stderr, so that a verb's stdout stays its result (`regenerate --json > summary.json` is JSON)."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

LOG_EVERY_S = 15.0


class Bar:
    """A handle on one task: `advance(n, tokens=total_so_far)` updates the counts and the rates."""

    def __init__(self, description: str, total: int | None, unit: str, progress: Progress | None):
        self.description, self.total, self.unit, self.progress = description, total, unit, progress
        self.task = progress.add_task(description, total=total, rate="") if progress else None
        self.start = self.last_line = time.perf_counter()
        self.done = 0

    def advance(self, n: int = 1, tokens: int | None = None, note: str = "") -> None:
        self.done += n
        now = time.perf_counter()
        dt = max(now - self.start, 1e-9)
        rate = f"{self.done / dt:.2f} {self.unit}/s" + (f" | {tokens / dt:,.0f} tok/s" if tokens is not None else "")
        rate += f" | {note}" if note else ""
        if self.progress is not None:
            self.progress.update(self.task, advance=n, rate=rate)
        elif now - self.last_line >= LOG_EVERY_S or (self.total and self.done >= self.total):
            self.last_line = now
            eta = (self.total - self.done) * dt / self.done if self.total and self.done else 0
            print(f"{self.description}: {self.done}/{self.total or '?'} {self.unit} | {dt:.0f} s | eta {eta:.0f} s | {rate}",
                  file=sys.stderr, flush=True)


@contextlib.contextmanager
def progress_bar(description: str, total: int | None, unit: str = "it") -> Iterator[Bar]:
    if not sys.stderr.isatty():
        yield Bar(description, total, unit, None)
        return
    columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("eta"), TimeRemainingColumn(), TextColumn("{task.fields[rate]}"))
    with Progress(*columns, transient=False, console=Console(stderr=True)) as progress:
        yield Bar(description, total, unit, progress)
