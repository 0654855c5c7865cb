"""Capture throughput on this CPU against the plain target forward over the same batches.

The plain forward is `model(input_ids)` of the causal LM (logits included), the same batches and
padding; capture is draftsmith's `target_features` (aux states, final state, argmax of the logits) plus
the bf16 copy and the shard write of `StoreWriter`, run as `capture` runs it (right-padded rows, no attention mask)
and, beside it, with the padding mask the target took before ed3c50f (`capture_masked_tokens_per_s`). Warm-up
batch excluded; `--reps` alternating repetitions, medians reported.

Run: .venv/bin/python benchmarks/bench_capture.py [--conversations FILE] [--limit 64]
Writes benchmarks/results/capture_cpu.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from draftsmith.capture.local import batches_by_tokens, pad_batch, target_features, tokenized_conversations
from draftsmith.capture.store import Sample, StoreWriter, bytes_per_token
from draftsmith.target import describe_target, load_target, read_config, resolve_target


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--conversations", type=Path, default=Path("runs/demo/conversations.jsonl"))
    ap.add_argument("--limit", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch-tokens", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=5, help="alternating plain / capture repetitions (median reported)")
    args = ap.parse_args()
    model_dir = resolve_target("smollm2")
    spec = describe_target(read_config(model_dir))
    model, tok = load_target(model_dir, dtype=args.dtype)
    samples = [s for _, s in tokenized_conversations(args.conversations, tok, 1024)][: args.limit]
    groups = [[samples[i] for i in g] for g in batches_by_tokens(samples, args.batch_tokens)]
    batches = [pad_batch(g, 0) for g in groups]
    aux_ids = spec.default_aux_ids
    tokens = sum(int(att.sum()) for _, att, _ in batches[1:])

    def plain() -> float:
        t = time.perf_counter()
        with torch.inference_mode():
            for ids, att, _ in batches[1:]:
                model(input_ids=ids, attention_mask=att, use_cache=False)
        return time.perf_counter() - t

    def capture(out: Path, masked: bool = False) -> float:
        writer = StoreWriter(out, {"bench": True}, shard_tokens=1 << 16)
        t = time.perf_counter()
        for (ids, att, loss), group in zip(batches[1:], groups[1:]):
            f = target_features(model, ids, att if masked else None, aux_ids)
            aux, last = f.aux.to(torch.bfloat16), f.last.to(torch.bfloat16)
            for b, s in enumerate(group):
                n = len(s.input_ids)
                writer.add(Sample(ids[b, :n], loss[b, :n], aux[b, :n], last[b, :n], f.target_argmax[b, :n]))
        writer.flush()
        return time.perf_counter() - t

    with torch.inference_mode():  # warm-up on the first batch
        model(input_ids=batches[0][0], attention_mask=batches[0][1])
    runs = []  # alternate the two so that drift in the machine's load hits both alike
    for _ in range(args.reps):
        with tempfile.TemporaryDirectory() as d:
            runs.append((plain(), capture(Path(d) / "store"), capture(Path(d) / "masked", masked=True)))
    plain_s = statistics.median(r[0] for r in runs)
    capture_s = statistics.median(r[1] for r in runs)
    masked_s = statistics.median(r[2] for r in runs)
    h = spec.hidden_size
    result = {"command": " ".join(sys.argv), "date": datetime.date.today().isoformat(), "device": platform.processor() or "cpu",
              "threads": torch.get_num_threads(), "dtype": args.dtype, "tokens": tokens, "batches": len(batches) - 1,
              "plain_forward_tokens_per_s": tokens / plain_s, "capture_tokens_per_s": tokens / capture_s,
              "ratio": plain_s / capture_s, "capture_masked_tokens_per_s": tokens / masked_s,
              "unmasked_over_masked": masked_s / capture_s, "reps": args.reps,
              "runs_s": [{"plain": round(a, 3), "capture": round(b, 3), "capture_masked": round(c, 3)} for a, b, c in runs],
              "load_average_1m": os.getloadavg()[0], "bytes_per_token_stored": bytes_per_token(h),
              "bytes_per_token_usual_8xHx2": 8 * h * 2, "hidden_size": h}
    out = Path("benchmarks/results/capture_cpu.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
