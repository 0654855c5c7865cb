"""Does a larger draft vocabulary raise tau with no training? The shipped drafter's head is the target's lm_head
rows of its 8,192 draft tokens, frozen (the normed recipe), so growing its vocabulary with more of the target's rows
(`vocab.grow_draft_vocab`, `drafter.with_draft_vocab`: what `train --init-from D --draft-vocab-size N` starts from)
changes nothing but which tokens it can propose. This measures tau of the shipped drafter and of grown copies on
the same prompts with the reference decoder (`draftsmith eval`, greedy, fp32).

    PYTHONPATH=src .venv/bin/python benchmarks/experiments/draft_vocab_growth.py --sizes 12288,49152 --counts-store runs/demo/store \
        --limit 32 --out benchmarks/results/draft_vocab_growth.json

--counts-store: the feature store whose supervised-token counts pick the added tokens (any size short of the whole
target vocabulary needs them); the whole vocabulary needs none.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from draftsmith.model.checkpoint import drafter_path, load_drafter, save_drafter
from draftsmith.model.eagle3 import Eagle3Drafter, with_draft_vocab
from draftsmith.target import load_target, resolve_target
from draftsmith.model.vocab import grow_draft_vocab


def grown_drafter(start: Eagle3Drafter, head: torch.Tensor, size: int, counts: torch.Tensor | None, out: Path) -> Path:
    """`start` grown to `size` tokens with the target's head rows `head` (V, H), written to `out`."""
    if counts is None:
        if size != start.config.vocab_size:
            raise SystemExit(f"--sizes {size}: a size short of the target's {start.config.vocab_size} tokens needs "
                             "--counts-store to pick the added tokens")
        counts = torch.zeros(start.config.vocab_size, dtype=torch.int64)
    vocab = grow_draft_vocab(start.d2t, counts, size)
    return save_drafter(with_draft_vocab(start, vocab.d2t, vocab.t2d, head), out)


def evaluate(drafter: str | Path, args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "eval.json"
        cmd = [sys.executable, "-m", "draftsmith", "eval", "--drafter", str(drafter), "--prompts", args.prompts,
               "--limit", str(args.limit), "--batch-size", str(args.limit), "--k", str(args.k), "--max-new-tokens",
               str(args.max_new_tokens), "--no-baseline", "--json", str(out)]
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        row = json.loads(out.read_text())
        return {"seconds": round(time.perf_counter() - t0, 1), "command": " ".join(cmd[1:]), "eval": row}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafter", default="smollm2")
    p.add_argument("--sizes", default="49152", help="comma-separated draft vocabulary sizes to grow to")
    p.add_argument("--counts-store", help="feature store whose token counts pick the added tokens")
    p.add_argument("--prompts", default="chat-eval")
    p.add_argument("--limit", type=int, default=32)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=192)
    p.add_argument("--out", default="benchmarks/results/draft_vocab_growth.json")
    args = p.parse_args()
    counts = None
    if args.counts_store:
        from draftsmith.capture.store import FeatureStore
        counts = FeatureStore(Path(args.counts_store)).token_counts()
    path = drafter_path(args.drafter)
    target = json.loads((path / "config.json").read_text())["draftsmith"]["target"]  # what it was trained for
    model, _ = load_target(resolve_target(target))
    start = load_drafter(path, model.get_input_embeddings().weight.detach().float())
    head = model.get_output_embeddings().weight.detach().float()
    rows = {"start": evaluate(args.drafter, args)}
    with tempfile.TemporaryDirectory() as tmp:
        for size in (int(s) for s in args.sizes.split(",")):
            d = grown_drafter(start, head, size, counts, Path(tmp) / f"grown{size}")
            rows[f"grown to {size}"] = evaluate(d, args)
    result = {"what": "tau of a drafter and of copies grown to larger draft vocabularies with the target's head "
                      "rows, no training (benchmarks/experiments/draft_vocab_growth.py)",
              "command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d"), "drafter": args.drafter,
              "counts_store": args.counts_store, "runs": rows}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    for name, r in rows.items():
        e = r["eval"]
        print(name, json.dumps(e)[:300])
    return 0


if __name__ == "__main__":
    sys.exit(main())
