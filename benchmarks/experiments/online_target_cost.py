"""What the target's forward costs in one online training step, at the embedded drafter's build shapes.

Online training (`draftsmith train --conversations`, what scripts/build_embedded_drafter.sh runs) calls the target
once per micro-batch over the packed rows' whole conversations, right-padded to the longest of them
(`OnlineSource.packed_batch`). The 2026-12-04 H200 build (docs/gpu-results.md, "Online training and capture")
stepped at a median 186 ms per 32,768-token row, bimodal (about 138 ms and 215 ms, the slow steps on rows of
longer conversations), while the drafter's step alone runs far faster
(benchmarks/results/train_step_profile_smollm2.json). This benchmark times that forward alone, with the padding
mask (as before ed3c50f) and without it (`target_features(..., None, ...)`, what capture and online training pass
now), on micro-batches planned the way the Trainer plans them (`train.pack_plan`) from lengths drawn from the
committed self-written SmolLM2 length histogram.

The target is SmolLM2-135M-shaped with random bf16 weights (its config below): no GGUF, so one device call suffices.
Token ids are random; the forward's cost does not depend on them.

    python3 benchmarks/experiments/online_target_cost.py --out $OUT/online_target_cost.json            # CUDA, bf16
    .venv/bin/python benchmarks/experiments/online_target_cost.py --device cpu --layers 6 --micro-batches 2 --row-tokens 2048 \\
        --out /tmp/x.json                                                                    # a smoke run
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_packing import draw_lengths, load_histogram  # noqa: E402

from draftsmith.capture.local import target_features  # noqa: E402
from draftsmith.conventions import default_aux_ids  # noqa: E402
from draftsmith.train.packing import pack_plan  # noqa: E402

HISTOGRAM = ROOT / "benchmarks/results/length_histogram_smollm2_self.json"


def smollm2_config(layers: int):
    """SmolLM2-135M-Instruct's shapes (the embedded target's GGUF metadata; docs/engines.md)."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
                       num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                       rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)


def timed(fn, device: torch.device, reps: int) -> float:
    """Median seconds of `reps` calls after one warm-up (the device synchronised around each)."""
    fn()
    out = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=30, help="target layers (SmolLM2-135M: 30; at least 6)")
    ap.add_argument("--row-tokens", type=int, default=32768, help="tokens per packed row (the build's BATCH_TOKENS)")
    ap.add_argument("--max-length", type=int, default=2048)
    ap.add_argument("--micro-batches", type=int, default=12, help="micro-batches timed, from the start of the plan")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--histogram", type=Path, default=HISTOGRAM)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()

    from transformers import LlamaForCausalLM

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = smollm2_config(args.layers)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(device, dtype).eval()
    lengths = [min(n, args.max_length) for n in draw_lengths(load_histogram(args.histogram), 4000, seed=0)]
    plan = pack_plan([(i, 0, n) for i, n in enumerate(lengths)], args.row_tokens, 1, seed=0, epoch=0)
    aux_ids = default_aux_ids(args.layers)  # EAGLE-3's (2, N//2, N-3); 6 layers at least
    rows = []
    for micro_batch in plan[:args.micro_batches]:
        keys = sorted({k for row in micro_batch for k, _, _ in row})
        longest = max(lengths[k] for k in keys)
        ids = torch.randint(0, cfg.vocab_size, (len(keys), longest), device=device)
        att = (torch.arange(longest, device=device) < torch.tensor([lengths[k] for k in keys], device=device)[:, None]).long()
        with torch.inference_mode():
            masked = timed(lambda: target_features(model, ids, att, aux_ids), device, args.reps)
            unmasked = timed(lambda: target_features(model, ids, None, aux_ids), device, args.reps)
        real = sum(lengths[k] for k in keys)
        rows.append({"conversations": len(keys), "longest": longest, "real_tokens": real,
                     "padded_over_real": round(len(keys) * longest / real, 3),
                     "masked_ms": round(masked * 1e3, 2), "unmasked_ms": round(unmasked * 1e3, 2)})
        print(json.dumps(rows[-1]), flush=True)
    med = lambda key: statistics.median(r[key] for r in rows)  # noqa: E731
    result = {
        "what": "the target's forward in one online training step (target_features over a packed micro-batch's "
                "conversations, right-padded), with the padding mask and without it",
        "command": " ".join(sys.argv), "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "dtype": str(dtype).removeprefix("torch."), "target": f"SmolLM2-135M shapes, "
        f"{args.layers} layers, random weights", "row_tokens": args.row_tokens, "histogram": str(args.histogram.name),
        "median_masked_ms": med("masked_ms"), "median_unmasked_ms": med("unmasked_ms"),
        "median_real_tokens": med("real_tokens"), "micro_batches": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"median over {len(rows)} micro-batches: masked {result['median_masked_ms']} ms, "
          f"unmasked {result['median_unmasked_ms']} ms -> {args.out}")


if __name__ == "__main__":
    main()
