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


def repeated_share(tokens: list[int], n: int = 8) -> float:
    """Share of the answer's n-grams that already occurred earlier in it (0: no loop; near 1: one loop)."""
    seen, repeated = set(), 0
    grams = [tuple(tokens[j:j + n]) for j in range(len(tokens) - n + 1)]
    for g in grams:
        repeated += g in seen
        seen.add(g)
    return repeated / max(len(grams), 1)


def main() -> None:
    from draftsmith.regenerate.chat import prompt_ids
    from draftsmith.regenerate.prompts import load_prompts
    from draftsmith.regenerate.command import LocalSettings, continue_ids
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
    prompts = load_prompts(a.prompts, a.limit)
    # regenerate's own greedy continuation (rows on CUDA, left-padded generate on CPU), stopping at EOS.
    settings = LocalSettings(max_new_tokens=a.max_new_tokens, batch_size=a.batch_size,
                             max_length=a.max_new_tokens + 1024)
    done = continue_ids(target, tok, [prompt_ids(tok, p.messages) for p in prompts], settings, [tok.eos_token_id])
    answers = [{"tokens": len(ids), "eos": n > len(ids), "repeated_8gram_share": round(repeated_share(ids), 4)}
               for ids, n in done]
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
