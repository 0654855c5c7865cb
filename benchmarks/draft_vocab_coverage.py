"""Draft-vocabulary coverage: the share of a conversations file's answer tokens that a drafter can propose at all.

The share of supervised (assistant) tokens that lie in the drafter's draft vocabulary (its `t2d` mask): a token
outside it is never drafted, whatever the drafter has learned. `benchmarks/experiments/draft_vocab_growth.py`
measured what a larger vocabulary buys in tau and costs in speed.

    .venv/bin/draftsmith regenerate --target smollm2 --prompts chat-eval --limit 200 --max-new-tokens 192 \
        --device cpu --dtype float32 --batch-size 50 --temperature 0 --out /tmp/chat_answers.jsonl
    PYTHONPATH=src .venv/bin/python benchmarks/draft_vocab_coverage.py --drafter smollm2 \
        --conversations /tmp/chat_answers.jsonl --source "the regenerate command above" \
        --out benchmarks/results/draft_vocab_coverage.json

The answers are re-tokenized with the target's chat template (`chat.tokenize_conversation`), as training reads them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoTokenizer

from draftsmith.regenerate.chat import tokenize_conversation
from draftsmith.model.checkpoint import drafter_path
from draftsmith.regenerate.conversations import read_conversations
from draftsmith.target import resolve_target
from draftsmith.model.vocab import vocab_from_maps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", default="smollm2", help="a drafter directory or a shipped drafter's short name")
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--conversations", type=Path, required=True, help="JSONL of {messages: [...]} records")
    ap.add_argument("--source", default="", help="how the conversations were made (recorded in the JSON)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(resolve_target(args.target))
    drafter = drafter_path(args.drafter)
    with safe_open(str(drafter / "model.safetensors"), framework="pt") as f:
        d2t = f.get_tensor("d2t")
    vocab_size = json.loads((drafter / "config.json").read_text())["vocab_size"]
    t2d = vocab_from_maps(d2t, vocab_size).t2d  # (V,): True where the target token has a draft id
    answers = []  # one (T_i,) tensor of supervised token ids per conversation
    for conv in read_conversations(args.conversations):
        sample = tokenize_conversation(tokenizer, conv.messages)
        answers.append(torch.tensor(sample.input_ids)[torch.tensor(sample.loss_mask, dtype=torch.bool)])
    ids = torch.cat(answers)
    inside = t2d[ids]
    supervised, covered, conversations = ids.numel(), int(inside.sum()), len(answers)
    missed = torch.bincount(ids[~inside], minlength=t2d.numel())
    top = missed.topk(20)
    result = {
        "what": __doc__.splitlines()[0], "command": shlex.join([Path(sys.executable).name, *sys.argv]),
        "date": str(datetime.date.today()), "drafter": str(args.drafter), "conversations_file": str(args.conversations),
        "conversations_source": args.source,
        "conversations": conversations, "draft_vocab_size": int(t2d.sum()), "target_vocab_size": t2d.numel(),
        "supervised_tokens": supervised, "in_draft_vocab": covered, "coverage": covered / max(supervised, 1),
        "most_missed": [{"token": tokenizer.convert_ids_to_tokens(int(i)), "count": int(c)}
                        for c, i in zip(top.values, top.indices) if c > 0],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{covered:,} of {supervised:,} supervised tokens in the draft vocabulary: {result['coverage']:.2%}")


if __name__ == "__main__":
    main()
