"""Decoder overhead: the share of speculative decoding wall time spent outside target and drafter forwards.

Target: the embedded SmolLM2-135M (`smollm2`). Drafter: a RANDOMLY INITIALISED EAGLE-3 drafter of the
demo's shape (draft vocabulary 4096, default aux ids): acceptance is therefore near zero, but every
verification step still drafts the full chain or tree, so the per-step bookkeeping measured here is the
same as with a trained drafter (which runs fewer steps per token; the share per step is what we report).
Forward time = wall time inside `target(...)` and inside the drafter's layer + head calls (`decoder.timed`,
synchronised on accelerators); everything else (masks, tree building, acceptance, cache surgery, the
host sync, Python) is overhead. Warm-up decode excluded.

Run: .venv/bin/python benchmarks/bench_decoder.py [--limit 8] [--max-new-tokens 64] [--threads 2]
Writes benchmarks/results/decoder_overhead.json (or --out). On a machine without SmolLM2's weights (the GPU
machine), `--target DIR --random-weights` builds the same architecture from DIR's config.json with random
weights (timings depend on shapes, not values) and DIR's tokenizer.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import time
from pathlib import Path

import torch

from draftsmith.regenerate.chat import prompt_ids
from draftsmith.eval.decoder import DecodeSettings, decode_batch, target_decode
from draftsmith.model.eagle3 import DrafterConfig, Eagle3Drafter
from draftsmith.regenerate.prompts import load_prompts
from draftsmith.target import describe_target, load_target, read_config, resolve_target
from draftsmith.model.vocab import build_draft_vocab

CONFIGS = {  # name: (settings fields, batch size)
    "chain k=4, batch 1": (dict(k=4), 1),
    "tree topk=4 draft_tokens=8 depth=5 (SGLang default), batch 1": (dict(k=5, topk=4, draft_tokens=8), 1),
    "chain k=4, batch 4": (dict(k=4), 4),
    "tree topk=4 draft_tokens=8 depth=5, batch 4": (dict(k=5, topk=4, draft_tokens=8), 4),
}


def random_drafter(target, spec, draft_vocab: int = 4096, seed: int = 0) -> Eagle3Drafter:
    cfg = DrafterConfig.from_target(spec, draft_vocab, tuple(spec.default_aux_ids))
    torch.manual_seed(seed)
    drafter = Eagle3Drafter(cfg).eval()
    vocab = build_draft_vocab(torch.arange(spec.vocab_size, 0, -1), draft_vocab)
    with torch.no_grad():
        drafter.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
        drafter.d2t.copy_(vocab.d2t)
        drafter.t2d.copy_(vocab.t2d)
    return drafter.to(target.device)


def measure(target, drafter, prompts, aux_ids, settings: DecodeSettings, batch: int) -> dict:
    wall = target_s = drafter_s = 0.0
    tokens = steps = 0
    for start in range(0, len(prompts), batch):
        res = decode_batch(target, drafter, prompts[start:start + batch], aux_ids, settings)
        wall, target_s, drafter_s = wall + res.seconds, target_s + res.target_seconds, drafter_s + res.drafter_seconds
        tokens += sum(len(t) for t in res.tokens)
        steps += max(len(a) for a in res.accepted)  # batched verification steps
    return {"wall_s": round(wall, 3), "target_forward_s": round(target_s, 3), "drafter_forward_s": round(drafter_s, 3),
            "overhead_s": round(wall - target_s - drafter_s, 3),
            "overhead_share": round(1 - (target_s + drafter_s) / wall, 4), "generated_tokens": tokens,
            "verify_steps": steps, "overhead_ms_per_step": round(1000 * (wall - target_s - drafter_s) / max(steps, 1), 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--random-weights", action="store_true", help="the target's architecture with random weights")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/decoder_overhead.json"))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = resolve_target(args.target)
    spec = describe_target(read_config(model_dir))
    if args.random_weights:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        torch.manual_seed(0)
        target = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir)).to(args.device).eval()
        tok = AutoTokenizer.from_pretrained(model_dir)
    else:
        target, tok = load_target(model_dir, device=args.device)
    drafter = random_drafter(target, spec)
    aux_ids = tuple(spec.default_aux_ids)
    prompts = [prompt_ids(tok, p.messages) for p in load_prompts("eval", args.limit)]
    decode_batch(target, drafter, prompts[:2], aux_ids, DecodeSettings(k=2, max_new_tokens=8))  # warm-up
    results = {}
    for name, (fields, batch) in CONFIGS.items():
        settings = DecodeSettings(max_new_tokens=args.max_new_tokens, **fields)
        results[name] = {"settings": {**fields, "batch_size": batch}, **measure(target, drafter, prompts, aux_ids,
                                                                               settings, batch)}
        print(f"{name}: overhead {results[name]['overhead_share']:.1%} "
              f"({results[name]['overhead_ms_per_step']} ms/step), wall {results[name]['wall_s']} s", flush=True)
    t0 = time.perf_counter()
    plain = sum(len(target_decode(target, p, DecodeSettings(max_new_tokens=args.max_new_tokens)).tokens) for p in prompts)
    plain_s = time.perf_counter() - t0
    payload = {
        "what": "share of speculative-decoding wall time outside target and drafter forwards (goal <= 10 %)",
        "drafter": "randomly initialised EAGLE-3 drafter of the demo's shape (draft vocab 4096): acceptance ~0, "
                   "so tokens/s here are not speed-ups; each step still drafts and verifies the full chain/tree",
        "target": f"{args.target} (fp32{', RANDOM weights of its architecture' if args.random_weights else ''})",
        "prompts": f"eval[:{args.limit}]",
        "max_new_tokens": args.max_new_tokens, "device": args.device, "torch_threads": torch.get_num_threads(),
        "load_average_1m_at_end": os.getloadavg()[0], "cpu_count": os.cpu_count(), "torch": torch.__version__,
        "python": platform.python_version(), "transformers": __import__("transformers").__version__,
        "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "command": "benchmarks/bench_decoder.py " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
                                                               if v is not None and k != "out"),
        "plain_target_greedy_tokens_per_s": round(plain / plain_s, 2),
        "configs": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
