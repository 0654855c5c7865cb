"""Local regeneration throughput: the rows decoder (static KV cache, refilled rows, CUDA graphs) against
transformers' `generate` on the same prompts, generated tokens per second.

Prompts are the built-in train prompts rendered with the chat template; greedy and sampled (T 0.7) runs, the
rows decoder at several row counts. The first `--warmup` prompts of each run are a warm-up (graph capture,
kernel selection) and are excluded. Greedy outputs of the two decoders are compared token by token on the
prompts both answered (bf16 on a GPU can differ by rounding; fp32 on a CPU should not).

    python3 benchmarks/bench_local_regenerate.py --device cuda --dtype bfloat16 --rows 256,1024 --prompts 2048
    .venv/bin/python benchmarks/bench_local_regenerate.py --device cpu --rows 16 --prompts 32 --generate-batch 16

Writes benchmarks/results/regenerate_local.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from draftsmith.regenerate.chat import prompt_ids
from draftsmith.regenerate.generation import RowDecodeSettings, decode_all
from draftsmith.regenerate.prompts import load_prompts
from draftsmith.regenerate.command import LocalSettings, continue_ids
from draftsmith.target import load_target, resolve_target

RESULTS = Path(__file__).parent / "results" / "regenerate_local.json"


def timed(fn):
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def run_rows(model, prefixes, rows, temperature, max_new, stop, max_length):
    s = RowDecodeSettings(max_new_tokens=max_new, temperature=temperature, top_p=1.0, rows=rows, max_length=max_length)
    decode_all(model, prefixes[: rows // 4 or 1], s, stop)  # warm-up: graph capture and kernels
    (done, stats), seconds = timed(lambda: decode_all(model, prefixes, s, stop))
    return [c.token_ids for c in done], stats.generated_tokens, seconds


def run_generate(model, tokenizer, prefixes, batch, temperature, max_new, stop):
    s = LocalSettings(max_new_tokens=max_new, batch_size=batch, temperature=temperature, decoder="generate")
    continue_ids(model, tokenizer, prefixes[:batch], s, stop)  # warm-up
    out, seconds = timed(lambda: continue_ids(model, tokenizer, prefixes, s, stop))
    return [ids for ids, _ in out], sum(n for _, n in out), seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompts", type=int, default=2048, help="train prompts per run (repeated when more than the set)")
    ap.add_argument("--rows", default="256,1024", help="row counts of the rows decoder")
    ap.add_argument("--generate-batch", type=int, default=256, help="batch of transformers' generate (0: skip it)")
    ap.add_argument("--generate-prompts", type=int, default=512, help="prompts for the (slow) generate run")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--max-length", type=int, default=1024)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()

    model, tokenizer = load_target(resolve_target(args.target), dtype=args.dtype, device=args.device)
    base = [prompt_ids(tokenizer, p.messages) for p in load_prompts("train")]
    prefixes = [base[i % len(base)] for i in range(args.prompts)]
    stop = [tokenizer.eos_token_id]
    runs, outputs = [], {}
    for temperature in (0.0, 0.7):
        for rows in [int(r) for r in args.rows.split(",")]:
            torch.manual_seed(0)
            ids, tokens, seconds = run_rows(model, prefixes, rows, temperature, args.max_new_tokens, stop, args.max_length)
            outputs[("rows", temperature)] = ids
            runs.append({"decoder": "rows", "rows": rows, "temperature": temperature, "prompts": len(prefixes),
                         "generated_tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds})
            print(json.dumps(runs[-1]), flush=True)
        if args.generate_batch:
            torch.manual_seed(0)
            some = prefixes[: args.generate_prompts]
            ids, tokens, seconds = run_generate(model, tokenizer, some, args.generate_batch, temperature,
                                                args.max_new_tokens, stop)
            outputs[("generate", temperature)] = ids
            runs.append({"decoder": "generate", "batch": args.generate_batch, "temperature": temperature,
                         "prompts": len(some), "generated_tokens": tokens, "seconds": seconds,
                         "tokens_per_s": tokens / seconds})
            print(json.dumps(runs[-1]), flush=True)
    same = None
    if ("generate", 0.0) in outputs:
        a, b = outputs[("rows", 0.0)], outputs[("generate", 0.0)]
        same = sum(x == y for x, y in zip(a, b)) / len(b)
    result = {"what": "local regeneration: rows decoder vs transformers generate, generated tokens/s",
              "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu",
              "torch": torch.__version__, "dtype": args.dtype, "max_new_tokens": args.max_new_tokens,
              "greedy_outputs_identical_share": same, "runs": runs,
              "command": "python3 benchmarks/bench_local_regenerate.py " + " ".join(
                  f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out")}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"greedy outputs identical (rows vs generate): {same}")


if __name__ == "__main__":
    main()
