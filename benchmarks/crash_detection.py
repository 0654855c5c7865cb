"""Crash-detection latency of `draftsmith launch` on a real vllm-cpu start with a broken drafter.

For each run, the engine starts with a drafter whose `fc.weight` has the wrong shape. An independent
watcher thread polls the log every 5 ms and records when the worker's `AssertionError` line first
appears; the supervisor records when it decided "crashed". Latency = decision - line seen. It also
records how long before the API server's own exit the decision came (the API server keeps running for
seconds while the engine core shuts down).

    .venv/bin/python benchmarks/crash_detection.py --runs 3     # about 1 minute per run on 2 cores

Writes benchmarks/results/crash_detection.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import tempfile
import sys
import threading
import time
from pathlib import Path

from draftsmith.engines.process import VLLM_CPU_ENV, VllmServe, engine_python, free_port
from draftsmith.engines.launch import POLL_S, spawn, stop_tree, supervise
from draftsmith.target import resolve_target

REPO = Path(__file__).resolve().parents[1]
NEEDLE = b"AssertionError: Tried to load weights"


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "tests" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def watch(log: Path, seen: dict, stop: threading.Event) -> None:
    while not stop.is_set():
        if log.exists() and NEEDLE in log.read_bytes():
            seen["t"] = time.monotonic()
            return
        time.sleep(0.005)


def one_run(python: Path, target: Path, drafter: Path, work: Path, i: int) -> dict:
    port = free_port()
    cmd = VllmServe(target=target, drafter=drafter, port=port, max_model_len=1024).command(python)
    log = work / f"run{i}.log"
    seen, stop = {}, threading.Event()
    watcher = threading.Thread(target=watch, args=(log, seen, stop), daemon=True)
    proc = spawn(cmd, log)
    watcher.start()
    res = supervise(log, f"http://127.0.0.1:{port}", proc, timeout_s=600, stall_s=300)
    alive_at_decision = proc.poll() is None
    stop_tree(proc)
    stop.set()
    watcher.join()
    return {"status": res.status, "root_cause": res.root_cause.text if res.root_cause else None,
            "latency_s": round(res.detected_at - seen["t"], 3) if "t" in seen else None,
            "engine_alive_at_decision": alive_at_decision, "elapsed_s": round(res.elapsed_s, 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "crash_detection.json")
    args = ap.parse_args()
    os.environ.update({**VLLM_CPU_ENV, "HF_HUB_OFFLINE": "1"})
    mk = load_script("make_crash_logs")
    python, target = engine_python("vllm"), resolve_target("smollm2")
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        tensors = mk.drafter_tensors()
        tensors["fc.weight"] = tensors["fc.weight"][:, :1152].contiguous()
        drafter = mk.write_drafter(work / "bad", tensors=tensors)
        for i in range(args.runs):
            runs.append(one_run(python, target, drafter, work, i))
            print(json.dumps(runs[-1]), flush=True)
    lat = [r["latency_s"] for r in runs if r["latency_s"] is not None]
    result = {
        "what": "seconds from the worker's AssertionError line appearing in the log to launch's crash verdict",
        "command": "benchmarks/crash_detection.py --runs %d" % args.runs,
        "engine": "vllm-cpu 0.32.0, SmolLM2-135M target, 1-layer EAGLE-3 drafter with fc.weight [576, 1152]",
        "poll_interval_s": POLL_S, "machine": f"{os.cpu_count()} CPU cores, shared",
        "latency_s": {"max": max(lat), "median": statistics.median(lat), "min": min(lat)} if lat else None,
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
