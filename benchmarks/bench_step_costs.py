"""What speculative decoding must reach on this machine: the cost of one verification against one token.

A chain of k draft tokens costs one target forward over k+1 tokens (the decoder's verify: explicit mask,
aux states, logits at every position) plus k drafter steps (layer + head over one token), and yields tau
tokens. Against plain decoding at T1 per token the speed-up is

    speedup(k) = tau * T1 / (T_verify(k+1) + k * T_draft)

so tau must reach (T_verify(k+1) + k T_draft) / T1 to break even, and 1.5x that for 1.5x. This measures
T1, T_verify(n) for n = 2..8 and T_draft on the embedded SmolLM2 target (fp32 as `draftsmith eval` runs
it by default, or --dtype bfloat16) with a randomly initialised drafter of the demo's shape (costs depend on shapes, not values), at a
context of --context tokens, medians of --reps, and prints the tau each k needs. Run on a quiet machine.

Run: .venv/bin/python benchmarks/bench_step_costs.py [--context 200] [--reps 15] [--threads 2] [--dtype bfloat16]
Writes benchmarks/results/step_costs.json (or --out).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from draftsmith.eval.decoder import draft_head, target_forward
from draftsmith.model.eagle3 import DrafterCache
from draftsmith.target import describe_target, load_target, read_config, resolve_target
from bench_decoder import random_drafter  # noqa: E402  (benchmarks/ is on sys.path when run as a script)


def median_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps + 2):
        setup = fn()  # returns the timed closure after untimed set-up (a fresh cache per repetition)
        t0 = time.perf_counter()
        setup()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:]) * 1000


def main() -> None:
    from transformers import DynamicCache

    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="target and drafter dtype")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "step_costs.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = resolve_target(args.target)
    target, _ = load_target(model_dir, dtype=args.dtype)
    spec = describe_target(read_config(model_dir))
    aux_ids = tuple(spec.default_aux_ids)
    drafter = random_drafter(target, spec).to(target.dtype)
    P = args.context
    g = torch.Generator().manual_seed(0)
    context = torch.randint(0, spec.vocab_size, (1, P), generator=g)

    def with_cache(run):
        def setup():
            cache = DynamicCache()
            target(input_ids=context, past_key_values=cache, use_cache=True, logits_to_keep=1)
            new = torch.randint(0, spec.vocab_size, (1, 8), generator=g)
            return lambda: run(cache, new)
        return setup

    def plain(cache, new):  # what plain greedy decoding runs per token (`decoder.target_decode`)
        target(input_ids=new[:, :1], past_key_values=cache, use_cache=True)

    def verify(n):
        def run(cache, new):
            allowed = torch.ones(1, n, P + n, dtype=torch.bool)
            allowed[0, :, P:] = torch.ones(n, n, dtype=torch.bool).tril()
            target_forward(target, new[:, :n], torch.arange(P, P + n)[None], cache, allowed, aux_ids)
        return run

    d_cache = DrafterCache()
    with torch.inference_mode():
        drafter.decode_step(context, torch.randn(1, P, spec.hidden_size, generator=g).to(target.dtype),
                            torch.arange(P)[None], d_cache, torch.ones(P, P, dtype=torch.bool).tril()[None])

        def draft_setup():
            cache = DrafterCache(d_cache.keys, d_cache.values)
            h = torch.randn(1, 1, spec.hidden_size, generator=g).to(target.dtype)
            allowed = torch.ones(1, 1, P + 1, dtype=torch.bool)
            return lambda: draft_head(drafter, drafter.decode_step(context[:, :1], h, torch.tensor([[P]]), cache,
                                                                   allowed))

        t1 = median_ms(with_cache(plain), args.reps)
        t_draft = median_ms(draft_setup, args.reps * 4)
        t_verify = {n: median_ms(with_cache(verify(n)), args.reps) for n in range(2, 9)}
    rows = []
    for k in range(1, 8):
        cycle = t_verify[k + 1] + k * t_draft
        rows.append({"k": k, "cycle_ms": round(cycle, 2), "tau_for_1x": round(cycle / t1, 3),
                     "tau_for_1_5x": round(1.5 * cycle / t1, 3), "max_tau": k + 1})
        print(f"k={k}: verify({k + 1}) {t_verify[k + 1]:.1f} ms + {k} x draft {t_draft:.2f} ms = {cycle:.1f} ms; "
              f"tau for 1.0x {cycle / t1:.2f}, for 1.5x {1.5 * cycle / t1:.2f} (max {k + 1})", flush=True)
    out = {"what": "cost of a speculative cycle against one plain decoding step (batch 1)",
           "target": f"{args.target} ({args.dtype})", "drafter": "random, the demo's shape (draft vocab 4096)",
           "context_tokens": P, "threads": args.threads, "cpu_count": os.cpu_count(),
           "load_average_1m_at_end": os.getloadavg()[0], "torch": torch.__version__, "python": platform.python_version(),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "command": "benchmarks/bench_step_costs.py " + " ".join(f"--{k} {v}" for k, v in
                                                                    (("context", P), ("reps", args.reps), ("threads", args.threads),
                                                                    ("dtype", args.dtype))),
           "plain_decode_ms": round(t1, 2), "draft_step_ms": round(t_draft, 3),
           "verify_ms": {str(n): round(t, 2) for n, t in t_verify.items()}, "per_k": rows}
    print(f"plain decode {t1:.1f} ms/token; drafter step {t_draft:.2f} ms ({t_draft / t1:.3f} of a token)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
