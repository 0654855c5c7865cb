"""How long and how repetitive the target's greedy answers to the chat-eval prompts are, with no length cap in sight.

Why: `draftsmith eval --max-new-tokens N` measures tau over the first N tokens of each answer. A longer N raises tau
(SmolLM2-135M drafter, 32 chat-eval prompts, k=4 on CPU: 2.74 at 192 tokens, 3.12 at 512), so before a longer cut is
used as the measure, this says how much of the longer text is the target repeating itself (greedy loops), which any
drafter accepts easily. Writes JSON: per answer its length, whether it ended with EOS, and the share of its 8-grams
already seen earlier in the same answer.

    PYTHONPATH=src python benchmarks/answer_lengths.py --limit 200 --max-new-tokens 1024 --out lengths.json
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch


def repeated_share(tokens: list[int], n: int = 8) -> float:
    """Share of the answer's n-grams that already occurred earlier in it (0: no loop; near 1: one loop)."""
    seen, repeated = set(), 0
    grams = [tuple(tokens[j:j + n]) for j in range(len(tokens) - n + 1)]
    for g in grams:
        repeated += g in seen
        seen.add(g)
    return repeated / max(len(grams), 1)


def main() -> None:
    from draftsmith.chat import prompt_ids
    from draftsmith.prompts import load_prompts
    from draftsmith.target import load_target, resolve_target

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--prompts", default="chat-eval")
    ap.add_argument("--limit", type=int, default=200)
    ap.add_argument("--max-new-tokens", type=int, default=1024)
    ap.add_argument("--batch-size", type=int, default=50)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    target, tok = load_target(resolve_target(a.target), dtype="float32", device=a.device)
    pad = tok.pad_token_id or 0
    prompts = load_prompts(a.prompts, a.limit)
    answers = []
    for i in range(0, len(prompts), a.batch_size):
        ids = [prompt_ids(tok, p.messages) for p in prompts[i:i + a.batch_size]]
        width = max(map(len, ids))
        x = torch.tensor([[pad] * (width - len(r)) + r for r in ids], device=target.device)  # left-padded
        m = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in ids], device=target.device)
        with torch.no_grad():
            out = target.generate(input_ids=x, attention_mask=m, max_new_tokens=a.max_new_tokens, do_sample=False,
                                  eos_token_id=tok.eos_token_id, pad_token_id=pad)
        for row in out[:, width:].tolist():
            ended = tok.eos_token_id in row
            toks = row[:row.index(tok.eos_token_id)] if ended else row
            answers.append({"tokens": len(toks), "eos": ended, "repeated_8gram_share": round(repeated_share(toks), 4)})
        print(f"{len(answers)}/{len(prompts)} answers", flush=True)
    lengths = [r["tokens"] for r in answers]
    summary = {"answers": len(answers), "ended_with_eos": sum(r["eos"] for r in answers),
               "median_tokens": statistics.median(lengths), "mean_tokens": statistics.mean(lengths),
               "at_least": {str(c): sum(n >= c for n in lengths) for c in (192, 256, 512, a.max_new_tokens)},
               "mean_repeated_8gram_share": statistics.mean(r["repeated_8gram_share"] for r in answers),
               "answers_mostly_loops (share > 0.5)": sum(r["repeated_8gram_share"] > 0.5 for r in answers)}
    json.dump({"what": "greedy answer lengths and self-repetition", "settings": vars(a), "summary": summary,
               "answers": answers}, open(a.out, "w"), indent=1)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
