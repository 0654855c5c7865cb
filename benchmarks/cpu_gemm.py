"""The reference decoder on this CPU with and without MKL-packed linear weights (`draftsmith.eval.cpu_gemm`).

Two measurements, each interleaved round by round so that both sides see the same machine state:

1. One target forward over n new tokens (n = 1, k + 1) after a 150-token context, as the decoders run it:
   plain `F.linear` against weights packed for that row count. Median and quartile of `--forwards` rounds.
2. `draftsmith eval`'s loop on its chat prompts (greedy, batch 1, float32; each prompt decoded by every variant
   in turn, the order rotating): plain decoding and speculative decoding at each k, unpacked and packed; plain decoding also with weights packed for 1 row, to show whether
   the baseline would be faster packed (eval leaves it unpacked at batch 1). Tokens/s per round and the
   median speed-up, and whether each speculative output equals plain decoding token for token. "+gqa": also with
   transformers' masked-GQA switch (`decoder.masked_gqa`, what eval sets on a CPU); the other variants run with it
   off, as before it existed.

    python benchmarks/cpu_gemm.py --out benchmarks/results/cpu_gemm.json
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


@torch.inference_mode()
def forward_ms(models: dict, rows: list[int], rounds: int, aux_ids: tuple[int, ...]) -> dict:
    """Median / first-quartile ms of one cached forward over n tokens, per variant (model, masked GQA) and n."""
    from transformers import DynamicCache

    from draftsmith.eval.decoder import MASKED_GQA, target_forward

    S = 150
    ctx = torch.randint(100, 20000, (1, S), generator=torch.Generator().manual_seed(0))
    caches = {}
    for name, (m, _) in models.items():
        caches[name] = DynamicCache()
        m(input_ids=ctx, past_key_values=caches[name], use_cache=True)
    times: dict[tuple[str, int], list[float]] = {}
    for _ in range(rounds):
        for name, (m, gqa) in models.items():
            os.environ[MASKED_GQA] = "1" if gqa else "0"
            for n in rows:
                ids = torch.randint(100, 20000, (1, n))
                allowed = torch.ones(1, n, S + n, dtype=torch.bool)
                allowed[0, :, S:] = torch.ones(n, n, dtype=torch.bool).tril()
                t0 = time.perf_counter()
                target_forward(m, ids, torch.arange(S, S + n)[None], caches[name], allowed, aux_ids if n > 1 else ())
                times.setdefault((name, n), []).append(time.perf_counter() - t0)
                caches[name].crop(-n)
    return {f"{name} n={n}": {"median_ms": 1000 * statistics.median(ts), "p25_ms": 1000 * sorted(ts)[len(ts) // 4]}
            for (name, n), ts in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", default="smollm2", help="drafter directory or shipped short name")
    ap.add_argument("--prompts", default="chat-eval")
    ap.add_argument("--limit", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--k", default="3,4")
    ap.add_argument("--rounds", type=int, default=3, help="decode rounds (all variants each round)")
    ap.add_argument("--forwards", type=int, default=40, help="single-forward rounds")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()

    from draftsmith.regenerate.chat import prompt_ids
    from draftsmith.model.checkpoint import drafter_path, load_drafter
    from draftsmith.conventions import engine_aux_ids
    from draftsmith.eval.cpu_gemm import pack_linears
    from draftsmith.eval.decoder import MASKED_GQA, DecodeSettings, decode_batch, target_decode
    from draftsmith.regenerate.prompts import load_prompts
    from draftsmith.target import describe_target, load_target, read_config, resolve_target

    ks = [int(k) for k in args.k.split(",")]
    model_dir = resolve_target("smollm2")
    spec = describe_target(read_config(model_dir))
    plain_model, tok = load_target(model_dir, dtype="float32", device="cpu")
    packed = copy.deepcopy(plain_model)
    report = pack_linears(packed, [k + 1 for k in ks])
    packed1 = copy.deepcopy(plain_model)
    report1 = pack_linears(packed1, [1])
    if report.skipped or report1.skipped:
        raise SystemExit(f"nothing to compare: {(report if report.skipped else report1).line()}")
    ddir = drafter_path(args.drafter)
    drafter = load_drafter(ddir, plain_model.get_input_embeddings().weight.detach().float()).float().eval()
    aux_ids = engine_aux_ids(json.loads((Path(ddir) / "config.json").read_text()), spec.num_layers, "vllm")

    fwd = forward_ms({"plain": (plain_model, False), "packed": (packed, False), "packed+gqa": (packed, True)},
                     [1] + [k + 1 for k in ks], args.forwards, aux_ids)
    for name, r in fwd.items():
        print(f"forward {name}: {r['median_ms']:.1f} ms (p25 {r['p25_ms']:.1f})", flush=True)

    prompts = []
    for p in load_prompts(args.prompts, args.limit):  # the first user turn of each conversation
        first = [m["role"] for m in p.messages].index("user")
        prompts.append(prompt_ids(tok, p.messages[:first + 1]))
    plain = DecodeSettings(k=0, max_new_tokens=args.max_new_tokens, eos_token_id=tok.eos_token_id)
    variants = [("plain", None), ("plain packed@1", None)] + [
        (f"k={k} {side}", k) for k in ks for side in ("unpacked", "packed", "packed+gqa")]
    reference = [target_decode(plain_model, ids, plain).tokens for ids in prompts]  # warm-up and identity reference
    rounds: list[dict] = []
    identical = {name: True for name, k in variants if k}
    for r in range(args.rounds):
        tokens = {name: 0 for name, _ in variants}
        secs = {name: 0.0 for name, _ in variants}
        for i, ids in enumerate(prompts):  # every variant on each prompt in turn, the order rotating
            shift = (i + r) % len(variants)
            for name, k in variants[shift:] + variants[:shift]:
                if k is None:
                    res = target_decode(packed1 if "packed" in name else plain_model, ids, plain)
                    out, sec = res.tokens, res.seconds
                else:
                    s = DecodeSettings(k=k, max_new_tokens=args.max_new_tokens, eos_token_id=tok.eos_token_id)
                    os.environ[MASKED_GQA] = "1" if name.endswith("+gqa") else "0"
                    res = decode_batch(plain_model if name.endswith("unpacked") else packed, drafter, [ids], aux_ids, s)
                    out, sec = res.tokens[0], res.seconds
                    identical[name] &= out == reference[i]
                tokens[name] += len(out)
                secs[name] += sec
        row = {name: tokens[name] / secs[name] for name, _ in variants}
        rounds.append(row)
        print(f"round {r}: " + ", ".join(f"{n} {v:.1f}" for n, v in row.items()) + " tok/s", flush=True)

    median = {n: statistics.median(rd[n] for rd in rounds) for n, _ in variants}
    base = max(median["plain"], median["plain packed@1"])
    speedups = {n: {"median_tok_s": median[n], "over_plain": median[n] / median["plain"],
                    "over_fastest_plain": median[n] / base, "identical_to_plain": identical[n]}
                for n, k in variants if k}
    result = {"what": __doc__.splitlines()[0], "command": " ".join(sys.argv), "date": str(datetime.date.today()),
              "cpu": cpu_name(), "threads": torch.get_num_threads(), "torch": torch.__version__,
              "pack": report.line(), "prompts": args.prompts, "limit": args.limit,
              "max_new_tokens": args.max_new_tokens, "forward_ms": fwd, "rounds_tok_s": rounds,
              "median_tok_s": median, "speedups": speedups}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for n, s in speedups.items():
        print(f"{n}: {s['over_plain']:.2f}x over plain ({s['over_fastest_plain']:.2f}x over the faster plain), "
              f"identical {s['identical_to_plain']}")


if __name__ == "__main__":
    main()
