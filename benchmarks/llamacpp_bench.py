"""Speed-up of a drafter in llama.cpp's `llama-server` at batch 1: one plain server, one speculative server per k,
each measured by `draftsmith bench` on the same prompts (f32 GGUFs of target and drafter, greedy, this CPU).

Starts engines: run it under the shared lock, on a quiet machine (the ratio is what it reports).

    flock /tmp/draftsmith-engine.lock .venv/bin/python benchmarks/llamacpp_bench.py --drafter smollm2 --k 2,3
    flock /tmp/draftsmith-engine.lock .venv/bin/python benchmarks/llamacpp_bench.py --k 3,4,5 --p-min 0,0.3,0.5
    flock /tmp/draftsmith-engine.lock .venv/bin/python benchmarks/llamacpp_bench.py --k 2,3,4 --outtype q8_0

Each (k, p-min) pair is one speculative server; the plain server is measured once, first, and again at the end
(`plain_end`): the ratio uses the mean of the two, so drift of the machine over the run shows and is halved.

Writes benchmarks/results/llamacpp_bench_embedded.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from draftsmith import llamacpp

OUT = Path(__file__).parent / "results" / "llamacpp_bench_embedded.json"


def bench(endpoint: str, args, k: int | None, concurrency: str = "1") -> dict:
    """`draftsmith bench --json` against one endpoint (args: prompt_set, prompts, max_tokens), parsed."""
    cmd = [sys.executable, "-m", "draftsmith", "bench", "--endpoint", endpoint, "--prompts", args.prompt_set,
           "--num-prompts", str(args.prompts), "--concurrency", concurrency, "--max-tokens", str(args.max_tokens),
           "--warmup", "1", "--json"]
    if k is not None:
        cmd += ["--num-speculative-tokens", str(k)]
    done = subprocess.run(cmd, capture_output=True, text=True)  # exit 1 is bench's no-go / inconclusive verdict
    try:
        return json.loads(done.stdout)
    except json.JSONDecodeError:
        raise SystemExit(f"bench failed (exit {done.returncode}):\n{done.stderr[-3000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--drafter", default="smollm2", help="draftsmith checkpoint directory or shipped short name")
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--k", default="2,3", help="draft lengths, a comma list")
    ap.add_argument("--p-min", default="0", help="drafter-probability cut-offs of a draft chain, a comma list "
                    "(llama-server --spec-draft-p-min; 0 drafts all k)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-set", default="chat-eval")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--outtype", default="f32", help="GGUF type of target and drafter (llama.cpp converter "
                    "--outtype: f32, bf16, f16, q8_0); the drafter is always trained on the fp32 target")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    from draftsmith.checkpoint import drafter_path
    from draftsmith.export import export
    from draftsmith.target import resolve_target

    ks = [int(k) for k in args.k.split(",")]
    p_mins = [float(p) for p in args.p_min.split(",")]
    target = resolve_target(args.target)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        gguf = export(drafter_path(args.drafter), tmp / "llamacpp", "llamacpp", "float32", ks[0], str(target))
        manifest = json.loads((gguf / "llamacpp.json").read_text())
        target_gguf, drafter_gguf = Path(manifest["target_gguf"]), gguf / manifest["drafter_gguf"]
        if args.outtype != "f32":  # the same two conversions at another type
            target_gguf = llamacpp.target_gguf(target, args.outtype)
            drafter_gguf = llamacpp.convert(gguf, tmp / f"drafter-{args.outtype}.gguf", args.outtype, target)
        with llamacpp.serve(llamacpp.LlamaServe(target_gguf), tmp / "plain.log") as base:
            plain = bench(base, args, None)
        runs = {}
        for k in ks:
            for p_min in p_mins:
                spec_args = llamacpp.LlamaServe(target_gguf, drafter_gguf, k=k, p_min=p_min)
                with llamacpp.serve(spec_args, tmp / f"spec{k}_{p_min:g}.log") as base:
                    spec = bench(base, args, k)
                key = str(k) if p_mins == [0.0] else f"{k}@{p_min:g}"
                runs[key] = {"k": k, "p_min": p_min, "tau": spec.get("tau"), "per_position": spec.get("per_position"),
                             "output_tokens_per_s": spec["levels"][0]["output_tokens_per_s"]}
                print(f"k={k} p_min={p_min:g}: {runs[key]['output_tokens_per_s']:.1f} tok/s, tau {spec.get('tau')}", flush=True)
        with llamacpp.serve(llamacpp.LlamaServe(target_gguf), tmp / "plain_end.log") as base:
            plain_end = bench(base, args, None)
    base_tps = (plain["levels"][0]["output_tokens_per_s"] + plain_end["levels"][0]["output_tokens_per_s"]) / 2
    for run in runs.values():
        run["baseline_output_tokens_per_s"] = base_tps
        run["speedup"] = run["output_tokens_per_s"] / base_tps
    best = max(runs, key=lambda key: runs[key]["speedup"])
    print(f"plain {plain['levels'][0]['output_tokens_per_s']:.1f} then {plain_end['levels'][0]['output_tokens_per_s']:.1f} "
          f"tok/s; best {best}: {runs[best]['speedup']:.2f}x", flush=True)
    result = {"what": f"llama-server ({args.outtype} target + {args.outtype} EAGLE-3 drafter GGUF of {args.drafter}) with and without the "
                      f"drafter, batch 1, {args.prompts} {args.prompt_set} prompts, {args.max_tokens} tokens",
              "date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}",
              "command": "flock /tmp/draftsmith-engine.lock .venv/bin/python benchmarks/llamacpp_bench.py "
                         + " ".join(sys.argv[1:]),
              "plain": plain["levels"][0], "plain_end": plain_end["levels"][0], "baseline_output_tokens_per_s": base_tps,
              "best": best, "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
