"""Summaries for a drafter build: what a conversations file holds, and a training run's eval curve.

    python3 scripts/conversation_stats.py CONVERSATIONS.jsonl --out data_summary.json [--target smollm2]
    python3 scripts/conversation_stats.py --training-curve RUN/metrics.jsonl --out training_curve.json

The data summary counts conversations by source (`meta.prompts`, temperature), by task kind of self-written
ones (`meta.kind`, `--self-kinds`), multi-turn share, tokens and
supervised tokens as the trainer tokenizes them, and a histogram of tokenized lengths (bins of 64 tokens:
the length distribution that benchmarks of packed training draw from). The curve lists every eval record
(step, epoch, simulated tau per k, per-step accuracy, loss).
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

BIN = 64


def data_summary(path: Path, target: str, max_length: int) -> dict:
    from draftsmith.capture.local import tokenized_conversations
    from draftsmith.regenerate.conversations import read_conversations
    from draftsmith.target import load_target, resolve_target

    _, tokenizer = load_target(resolve_target(target), device="cpu")
    sources: Counter = Counter()
    kinds: Counter = Counter()
    n = multi = 0
    for conv in read_conversations(path):
        n += 1
        multi += sum(m["role"] == "user" for m in conv.messages) > 1
        sources[f"{conv.meta.get('prompts', 'builtin')}, T {conv.meta.get('temperature')}"] += 1
        kinds[conv.meta.get("kind", "none recorded")] += 1
    samples = [s for _, s in tokenized_conversations(path, tokenizer, max_length)]
    lengths = Counter(len(s.input_ids) // BIN * BIN for s in samples)
    return {"conversations": n, "multi_turn": multi, "multi_turn_share": multi / max(n, 1), "by_source": dict(sources),
            "by_kind": dict(kinds),
            "tokens": sum(len(s.input_ids) for s in samples), "supervised_tokens": sum(s.num_supervised for s in samples),
            "max_length": max_length,
            "length_histogram": {"bin_tokens": BIN, "counts": {str(k): v for k, v in sorted(lengths.items())}}}


def training_curve(metrics: Path) -> dict:
    steps, evals = [], []
    for line in metrics.read_text().splitlines():
        rec = json.loads(line)
        (evals if "eval" in rec else steps).append(rec)
    tok = sorted(r["tok_per_s"] for r in steps if "tok_per_s" in r)
    return {"steps": len(steps), "median_tokens_per_s": tok[len(tok) // 2] if tok else None,
            "tokens_trained": sum(r.get("tokens", 0) for r in steps),
            "loss_every_25": [(r["step"], round(r["loss"], 4)) for r in steps if r["step"] % 25 == 0],
            "eval": [{"step": r["step"], "loss": r["eval"]["loss"], "acc": r["eval"]["acc"],
                      "sim_tau": r["eval"]["tau"],  # chains placed as an engine places them (engine_walk_acceptance)
                      "sim_tau_all_starts": r["eval"].get("tau_all_starts")}  # a chain at every index (older runs: absent)
                     for r in evals]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("conversations", nargs="?", type=Path)
    ap.add_argument("--training-curve", type=Path, help="a run's metrics.jsonl instead of a conversations file")
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--max-length", type=int, default=2048)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    result = (training_curve(args.training_curve) if args.training_curve
              else data_summary(args.conversations, args.target, args.max_length))
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k not in ("length_histogram", "loss_every_25", "eval")}))


if __name__ == "__main__":
    main()
