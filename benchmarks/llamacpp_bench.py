"""Speed-up of a drafter in llama.cpp's `llama-server` at batch 1: one plain server, one speculative server per k,
each measured by `draftsmith bench` on the same prompts (f32 GGUFs of target and drafter, greedy, this CPU).

Starts engines: run it under the shared lock, on a quiet machine (the ratio is what it reports).

    flock /tmp/draftsmith-engine.lock .venv/bin/python benchmarks/llamacpp_bench.py --drafter smollm2 --k 2,3
    flock /tmp/draftsmith-engine.lock .venv/bin/python benchmarks/llamacpp_bench.py --k 3,4,5 --p-min 0,0.3,0.5
    flock /tmp/draftsmith-engine.lock .venv/bin/python benchmarks/llamacpp_bench.py --k 2,3,4 --outtype q8_0

Each (k, p-min) pair is one speculative server; the plain server is measured once, first, and again at the end
(`plain_end`): the ratio uses the mean of the two, so drift of the machine over the run shows and is halved.

With --repeats N (an A/B of settings) every server runs at once, prompt cache off (a prompt sent twice costs the
same both times), and each speculative server is benched against the plain one by `draftsmith bench
--baseline-endpoint --rounds R` (the two take turns within the call); that is repeated N
times, the order of the speculative servers rotating. The speed-up of a setting is the median of its N calls (those without heavy load
from other processes, benchmarks/machine_load.py), each call's listed:

    flock /tmp/draftsmith-engine.lock .venv/bin/python benchmarks/llamacpp_bench.py --k 3 --p-min 0,0.3,0.5 \
        --repeats 3 --rounds 4 --out benchmarks/results/llamacpp_p_min_ab_f32_k3.json

Writes benchmarks/results/llamacpp_bench_embedded.json (or --out).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from draftsmith.engines import llamacpp

OUT = Path(__file__).parent / "results" / "llamacpp_bench_embedded.json"


def bench(endpoint: str, args, k: int | None, concurrency: str = "1", baseline: str | None = None) -> dict:
    """`draftsmith bench --json` against one endpoint (args: prompt_set, prompts, max_tokens, rounds), parsed;
    with `baseline`, that endpoint takes turns with it and the levels carry the speed-up."""
    cmd = [sys.executable, "-m", "draftsmith", "bench", "--endpoint", endpoint, "--prompts", args.prompt_set,
           "--num-prompts", str(args.prompts), "--concurrency", concurrency, "--max-tokens", str(args.max_tokens),
           "--warmup", "1", "--json"]
    if k is not None:
        cmd += ["--num-speculative-tokens", str(k)]
    if baseline is not None:
        cmd += ["--baseline-endpoint", baseline, "--rounds", str(args.rounds)]
    done = subprocess.run(cmd, capture_output=True, text=True)  # exit 1 is bench's no-go / inconclusive verdict
    try:
        return json.loads(done.stdout)
    except json.JSONDecodeError:
        raise SystemExit(f"bench failed (exit {done.returncode}):\n{done.stderr[-3000:]}")


def export_dir(tmp: Path) -> Path:
    """Where `gguf_pair` exports the drafter (its vLLM-layout files, which the converter reads again for another type)."""
    return tmp / "llamacpp"


def gguf_pair(drafter: str, target: str, outtype: str, tmp: Path) -> tuple[Path, Path]:
    """Target and drafter GGUFs at `outtype`: the drafter exported (`--format llamacpp`, f32) into `tmp`, and
    for another type both converted again by llama.cpp's converter (the target once, cached)."""
    from draftsmith.model.checkpoint import drafter_path
    from draftsmith.export.formats import export
    from draftsmith.target import resolve_target

    target_dir = resolve_target(target)
    gguf = export(drafter_path(drafter), export_dir(tmp), "llamacpp", "float32", 3, str(target_dir))
    manifest = json.loads((gguf / "llamacpp.json").read_text())
    if outtype == "f32":
        return Path(manifest["target_gguf"]), gguf / manifest["drafter_gguf"]
    return (llamacpp.target_gguf(target_dir, outtype),
            llamacpp.convert(gguf, tmp / f"drafter-{outtype}.gguf", outtype, target_dir))


def interleaved(args, target_gguf: Path, drafter_gguf: Path, settings: list[tuple[int, float]], tmp: Path) -> dict:
    """Every (k, p_min) server against one plain server, all running at once (module docstring). Each call waits
    for a calm machine first; a call during which other processes kept more than --max-foreign cores busy
    (machine_load.py) is listed but left out of the median."""
    from machine_load import Meter, wait_quiet  # benchmarks/ is on sys.path when run as a script

    flags = ("--no-cache-prompt",)  # every prompt processed in full, each time
    runs: dict[str, dict] = {f"{k}@{p:g}": {"k": k, "p_min": p, "calls": []} for k, p in settings}
    with contextlib.ExitStack() as stack:
        plain = stack.enter_context(llamacpp.serve(llamacpp.LlamaServe(target_gguf, extra_args=flags), tmp / "plain.log"))
        bases = {key: stack.enter_context(llamacpp.serve(llamacpp.LlamaServe(
            target_gguf, drafter_gguf, k=run["k"], p_min=run["p_min"], extra_args=flags), tmp / f"{key}.log"))
            for key, run in runs.items()}
        keys = list(runs)
        deadline = time.monotonic() + args.budget_s
        for rep in range(args.repeats):
            for key in keys[rep % len(keys):] + keys[:rep % len(keys)]:
                if time.monotonic() > deadline:  # the engine lock is shared: hold it minutes, not an hour
                    print(f"--budget-s {args.budget_s:g} spent: no call for {key} in repeat {rep + 1}", flush=True)
                    continue
                wait_quiet(args.max_foreign / 2, 60.0)
                with Meter() as m:
                    report = bench(bases[key], args, runs[key]["k"], baseline=plain)
                level = report["levels"][0]
                runs[key]["calls"].append({"speedup": level["speedup"], "output_tokens_per_s": level["output_tokens_per_s"],
                                           "baseline_output_tokens_per_s": level["baseline_output_tokens_per_s"],
                                           "rounds_tokens_per_s": level.get("rounds_tokens_per_s"),
                                           "tau": report.get("tau"), "foreign_cores": m.cores,
                                           "major_faults": m.major_faults, "kept": m.cores <= args.max_foreign})
                print(f"repeat {rep + 1} {key}: {level['speedup']:.2f}x ({level['output_tokens_per_s']:.1f} against "
                      f"{level['baseline_output_tokens_per_s']:.1f} tok/s), tau {report.get('tau'):.2f}, "
                      f"other processes {m.cores:.2f} cores", flush=True)
    for run in runs.values():
        if not run["calls"]:
            continue
        kept = [c for c in run["calls"] if c["kept"]] or run["calls"]
        run["speedup"] = statistics.median(c["speedup"] for c in kept)
        run["tau"] = statistics.median(c["tau"] for c in kept)
        run["calls_kept"] = f"{sum(c['kept'] for c in run['calls'])}/{len(run['calls'])}"
    return runs


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
    ap.add_argument("--repeats", type=int, default=0, help="A/B mode: all servers at once, each speculative one "
                    "benched against the plain one this many times (0: one after the other, plain first and last)")
    ap.add_argument("--rounds", type=int, default=4, help="A/B mode: turns of the two servers within one bench call")
    ap.add_argument("--max-foreign", type=float, default=0.25, help="A/B mode: leave out a call during which other "
                    "processes kept more than this many cores busy")
    ap.add_argument("--budget-s", type=float, default=480.0, help="A/B mode: start no bench call after this many "
                    "seconds (a call under load from other processes can take minutes)")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    ks = [int(k) for k in args.k.split(",")]
    p_mins = [float(p) for p in args.p_min.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        target_gguf, drafter_gguf = gguf_pair(args.drafter, args.target, args.outtype, tmp)
        if args.repeats:
            runs = interleaved(args, target_gguf, drafter_gguf, [(k, p) for k in ks for p in p_mins], tmp)
            write(args, {"mode": f"interleaved: {args.repeats} bench calls per setting against one plain server, "
                                 f"{args.rounds} rounds each, prompt cache off", "runs": runs})
            return
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
    write(args, {"plain": plain["levels"][0], "plain_end": plain_end["levels"][0],
                 "baseline_output_tokens_per_s": base_tps, "best": best, "runs": runs})


def write(args, measured: dict) -> None:
    result = {"what": f"llama-server ({args.outtype} target + {args.outtype} EAGLE-3 drafter GGUF of {args.drafter}) with and without the "
                      f"drafter, batch 1, {args.prompts} {args.prompt_set} prompts, {args.max_tokens} tokens",
              "date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}",
              "command": "flock /tmp/draftsmith-engine.lock .venv/bin/python benchmarks/llamacpp_bench.py "
                         + " ".join(sys.argv[1:]), **measured}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
