"""Progress bars for long work: items/s plus a second rate (tokens/s) where it matters."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


class Bar:
    """A handle on one task of a rich Progress: `advance(n, tokens=total_so_far)`."""

    def __init__(self, progress: Progress, task: int, unit: str):
        self.progress, self.task, self.unit = progress, task, unit
        self.start = time.perf_counter()
        self.done = 0

    def advance(self, n: int = 1, tokens: int | None = None, note: str = "") -> None:
        self.done += n
        dt = max(time.perf_counter() - self.start, 1e-9)
        rate = f"{self.done / dt:.2f} {self.unit}/s"
        if tokens is not None:
            rate += f" | {tokens / dt:,.0f} tok/s"
        self.progress.update(self.task, advance=n, rate=rate + (f" | {note}" if note else ""))


@contextlib.contextmanager
def progress_bar(description: str, total: int | None, unit: str = "it") -> Iterator[Bar]:
    columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("eta"), TimeRemainingColumn(), TextColumn("{task.fields[rate]}"))
    with Progress(*columns, transient=False) as progress:
        task = progress.add_task(description, total=total, rate="")
        yield Bar(progress, task, unit)
