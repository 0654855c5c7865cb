"""How busy the shared machine was while a benchmark measured: CPU taken by other processes, and page-ins.

Other sessions share these 2 cores; the engine lock keeps their engines away, not their tests or training. A
benchmark measures inside `with Meter() as m:` and drops (or flags) what ran while m.cores, the cores other
processes kept busy, was high; `wait_quiet` holds the next measurement back until the machine is calm.
m.major_faults counts pages read back from disk machine-wide: a model file mapped into memory (llama-server's
default) is read again when other work pushes it out of the page cache. (One f32 A/B call of llamacpp_bench.py
ran at 4 tok/s against about 50 in the others, before these counters were recorded; its cause is not known.)

Used by llamacpp_step_costs.py and llamacpp_bench.py (--repeats).
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


def foreign_cores(busy_s: float, ours_s: float, wall_s: float) -> float:
    """Cores other processes kept busy over `wall_s`: the machine's busy CPU time minus this process tree's."""
    return max(0.0, busy_s - ours_s) / wall_s if wall_s > 0 else 0.0


def cpu_now() -> tuple[float, float, float, int]:
    """(wall s, busy CPU s of the machine, CPU s of this process and its descendants, major faults so far)."""
    from draftsmith.engines.process import descendants

    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    busy = sum(fields) - fields[3] - fields[4]  # all but idle and iowait
    ours = 0
    for pid in [os.getpid(), *descendants(os.getpid())]:
        with contextlib.suppress(OSError, IndexError):
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            ours += int(stat[11]) + int(stat[12])  # utime, stime
    faults = next(int(line.split()[1]) for line in Path("/proc/vmstat").read_text().splitlines()
                  if line.startswith("pgmajfault "))
    return time.monotonic(), busy / TICK, ours / TICK, faults


class Meter:
    """`with Meter() as m: ...`, then m.cores (other processes' cores) and m.major_faults (machine-wide)."""

    def __enter__(self) -> Meter:
        self.start = cpu_now()
        return self

    def __exit__(self, *exc) -> None:
        end = cpu_now()
        self.cores = foreign_cores(end[1] - self.start[1], end[2] - self.start[2], end[0] - self.start[0])
        self.major_faults = end[3] - self.start[3]


def wait_quiet(limit: float, max_wait_s: float) -> float:
    """Wait (up to max_wait_s) until other processes keep under `limit` cores busy over half a second; seconds waited."""
    t0 = time.monotonic()
    while True:
        with Meter() as m:
            time.sleep(0.5)
        if m.cores < limit or time.monotonic() - t0 > max_wait_s:
            return time.monotonic() - t0
