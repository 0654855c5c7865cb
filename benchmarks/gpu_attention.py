"""TTT attention on the GPU: what the diagonal costs, summary key against log-sum-exp merge.

`kernels.ttt_attention` folds the diagonal keys of TTT steps 1..i into one extra key with two extra
channels, so its causal SDPA runs at head dim 136 instead of 128. `kernels.ttt_attention_lse` runs the
causal part with a flash kernel (cuDNN's, or FlashAttention-2's) at head dim 128 (`CausalAttentionLSE`,
its log-sum-exp made differentiable) and merges the diagonal in closed form; `--flex` adds a third candidate with the same
merge over FlexAttention's log-sum-exp. Timed: forward + backward of one call at Llama-3.1-8B drafter
shapes (B 1, 32 / 8 heads, hd 128, bf16), median of 20 after 5 warm-up calls; the candidates' outputs and
gradients are compared with `ttt_attention` first.

Run (GPU machine): python3 benchmarks/gpu_attention.py --out results.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from draftsmith.model.kernels import CausalAttentionLSE, ttt_attention, ttt_attention_lse  # noqa: E402


def flex_causal(flex, block_mask):
    """(q, k, v, scale) -> (out, lse) by FlexAttention, whose log-sum-exp is differentiable."""
    return lambda q, k, v, scale: flex(q, k, v, block_mask=block_mask, scale=scale, return_lse=True)


def timed(fn, inputs, warmup: int = 5, reps: int = 20) -> float:
    times = []
    for r in range(warmup + reps):
        for t in inputs:
            t.grad = None
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        out.backward(torch.ones_like(out))
        torch.cuda.synchronize()
        if r >= warmup:
            times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2] * 1000


def main() -> None:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/gpu_attention.json"))
    ap.add_argument("--flex", action="store_true", help="also time the merge over FlexAttention")
    args = ap.parse_args()
    dev, T, nh, nkv, hd = "cuda", args.seq, 32, 8, 128
    candidates = {"lse_merge_cudnn_ms": ttt_attention_lse,
                  "lse_merge_flash_ms": lambda *a: ttt_attention_lse(
                      *a, causal=lambda q, k, v, s: CausalAttentionLSE.apply(q, k, v, s, "flash"))}
    if args.flex:
        causal = flex_causal(torch.compile(flex_attention),
                             create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, T, T, device=dev))
        candidates["lse_merge_flex_ms"] = lambda *a: ttt_attention_lse(*a, causal=causal)
    torch.manual_seed(0)

    def tensors(steps):
        q = torch.randn(1, nh, T, hd, device=dev, dtype=torch.bfloat16, requires_grad=True)
        kv = [torch.randn(1, nkv, T, hd, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(2 + 2 * steps)]
        return q, kv[0], kv[1], kv[2::2][:steps], kv[3::2][:steps]

    results = {"command": " ".join(sys.argv), "date": datetime.date.today().isoformat(),
               "device": torch.cuda.get_device_name(), "torch": torch.__version__, "seq": T, "rows": []}
    # Agreement first: outputs and gradients of the candidate against ttt_attention, 6 diagonal steps.
    q, k0, v0, dk, dv = tensors(6)
    leaves = [q, k0, v0, *dk, *dv]
    ref = ttt_attention(q, k0, v0, dk, dv)
    g_ref = torch.autograd.grad(ref.float().square().sum(), leaves)
    results["agreement_with_summary_key"] = {}
    for name, fn in candidates.items():
        cand = fn(q, k0, v0, dk, dv)
        g_cand = torch.autograd.grad(cand.float().square().sum(), leaves)
        results["agreement_with_summary_key"][name[:-3]] = {
            "out_max_abs_diff": (ref.float() - cand.float()).abs().max().item(),
            "out_max_abs": ref.float().abs().max().item(),
            "grad_max_rel_diff": max(((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
                                     for a, b in zip(g_cand, g_ref))}
    print(json.dumps(results["agreement_with_summary_key"]), flush=True)
    for steps in (0, 1, 3, 6):
        q, k0, v0, dk, dv = tensors(steps)
        leaves = [q, k0, v0, *dk, *dv]
        row = {"diag_steps": steps, "summary_key_ms": timed(lambda: ttt_attention(q, k0, v0, dk, dv), leaves)}
        for name, fn in candidates.items():
            row[name] = timed(lambda: fn(q, k0, v0, dk, dv), leaves)
        if steps == 0:
            row["sdpa_causal_hd128_ms"] = timed(
                lambda: F.scaled_dot_product_attention(q, k0, v0, is_causal=True, enable_gqa=True), leaves)
        print(json.dumps(row), flush=True)
        results["rows"].append(row)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
