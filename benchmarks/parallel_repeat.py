"""Consecutive passes of the two-process training tests (gloo DDP and FSDP2, packing on) under CPU load.

Issue 21 asks for 50 consecutive passes of both parallel modes under load after a rank-0 SIGABRT at exit
("terminate called without an active exception") seen once in a fresh-clone `make test`. Each round runs
`tests/test_train.py::test_two_processes_match_one_process_with_the_same_global_batch` for ddp and fsdp
(packed) in a fresh pytest process while `--load` busy processes keep every core occupied; any failure,
and any abort text in the output, is recorded with its round.

    .venv/bin/python benchmarks/parallel_repeat.py --rounds 50 --load 2 --out benchmarks/results/parallel_repeat.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ["tests/test_train.py::test_two_processes_match_one_process_with_the_same_global_batch[ddp-pack]",
         "tests/test_train.py::test_two_processes_match_one_process_with_the_same_global_batch[fsdp-pack]"]
ABORT_TEXT = ("terminate called", "SIGABRT", "Signal 6", "core dumped")


def spin() -> None:
    while True:
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--load", type=int, default=os.cpu_count() or 2, help="busy processes beside the tests")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    spinners = [mp.Process(target=spin, daemon=True) for _ in range(args.load)]
    for p in spinners:
        p.start()
    rounds, t_start = [], time.perf_counter()
    try:
        for i in range(args.rounds):
            t0 = time.perf_counter()
            r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS], cwd=ROOT,
                               capture_output=True, text=True)
            text = r.stdout + r.stderr
            rounds.append({"round": i + 1, "rc": r.returncode, "seconds": round(time.perf_counter() - t0, 1),
                           "abort_text": [a for a in ABORT_TEXT if a in text],
                           "summary": (r.stdout.strip().splitlines() or [""])[-1]})
            print(json.dumps(rounds[-1]), flush=True)
            if r.returncode != 0:
                rounds[-1]["tail"] = text[-4000:]
    finally:
        for p in spinners:
            p.terminate()
    passed = [r for r in rounds if r["rc"] == 0 and not r["abort_text"]]
    result = {"what": __doc__.splitlines()[0], "command": " ".join([sys.executable, *sys.argv]),
              "date": str(datetime.date.today()), "cpus": os.cpu_count(), "load_processes": args.load,
              "tests": TESTS, "rounds": len(rounds), "rounds_passed": len(passed),
              "consecutive_from_start": next((i for i, r in enumerate(rounds) if r not in passed), len(rounds)),
              "wall_s": round(time.perf_counter() - t_start, 1), "per_round": rounds}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{len(passed)}/{len(rounds)} rounds passed (both modes) under {args.load} busy processes -> {args.out}")
    sys.exit(0 if len(passed) == len(rounds) else 1)


if __name__ == "__main__":
    main()
