"""GPU throughput of draftsmith's offline TTT training step and of capture, at Llama-3.1-8B shapes.

Randomly initialised models of real shapes, the settings of the SpecForge anchor in issue 12: drafter
hidden 4096, intermediate 14336, 32 / 8 heads, draft vocab 32,000, target vocab 128,256, TTT 7, batch 1,
bf16 autocast with fp32 master weights, AdamW, clip 0.5; 3 warm-up steps, then 10 timed steps with the
device synchronised before each clock read.

FLOPs per token (stated, as in the issue): 17.8 GFLOP for the TTT-7 step; MFU against 989 TFLOP/s dense bf16.

Run (on the GPU machine): python benchmarks/gpu_train.py --seq 2048,4096,8192 --capture --out results.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from draftsmith.drafter import DrafterConfig, Eagle3Drafter, ttt_forward  # noqa: E402

FLOP_PER_TOKEN = 17.8e9  # issue 12: 7 TTT steps fwd+bwd through the layer and draft head, plus the target head
PEAK_BF16 = 989e12  # H100/H200 dense bf16 datasheet


def llama8b_drafter() -> DrafterConfig:
    return DrafterConfig(hidden_size=4096, intermediate_size=14336, num_heads=32, num_kv_heads=8, head_dim=128,
                         vocab_size=128256, draft_vocab_size=32000, target_hidden_size=4096, target_num_layers=32,
                         aux_layer_ids=(2, 16, 29), rms_norm_eps=1e-5, rope_theta=500000.0,
                         max_position_embeddings=131072)


def sync_time() -> float:
    torch.cuda.synchronize()
    return time.perf_counter()


def bench_train(seq: int, steps: int = 10, warmup: int = 3, ttt: int = 7, compile_step: bool = False,
                profile: bool = False) -> dict:
    dev = torch.device("cuda")
    torch.manual_seed(0)
    drafter = Eagle3Drafter(llama8b_drafter()).to(dev)
    if compile_step:
        drafter.step = torch.compile(drafter.step, dynamic=False)
    drafter.d2t.copy_(torch.arange(32000, device=dev) * 4 - torch.arange(32000, device=dev))
    drafter.t2d.zero_()
    drafter.t2d[torch.arange(32000, device=dev) * 4] = True
    head = (torch.randn(128256, 4096, device=dev) * 0.02).to(torch.bfloat16)
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), fused=True)
    aux = torch.randn(1, seq, 3 * 4096, device=dev, dtype=torch.bfloat16)
    last = torch.randn(1, seq, 4096, device=dev, dtype=torch.bfloat16)
    ids = torch.randint(0, 128256, (1, seq), device=dev)
    mask = torch.ones(1, seq, dtype=torch.long, device=dev)
    torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(warmup + steps):
        t0 = sync_time()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = ttt_forward(drafter, aux, ids, mask, last, head, steps=ttt)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()
        opt.zero_grad(set_to_none=True)
        t1 = sync_time()
        if i >= warmup:
            times.append(t1 - t0)
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = ttt_forward(drafter, aux, ids, mask, last, head, steps=ttt)
            out.loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=70))
    times.sort()
    step_s = times[len(times) // 2]
    tok_s = seq / step_s
    return {"seq": seq, "ttt": ttt, "compiled": compile_step, "tokens_per_s": tok_s, "step_ms": step_s * 1000,
            "peak_gb": torch.cuda.max_memory_allocated() / 1e9, "mfu": tok_s * FLOP_PER_TOKEN / PEAK_BF16,
            "trainable_params_m": sum(p.numel() for p in params) / 1e6}


def bench_capture(seq: int = 4096, batches: int = 5) -> dict:
    """Pure target forward against draftsmith's target_features (aux + final state) on the same batches."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from draftsmith.capture import target_features

    cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0)
    cfg._attn_implementation = "sdpa"
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    ids = torch.randint(0, 128256, (1, seq), device="cuda")
    att = torch.ones_like(ids)
    res = {}
    for name, fn in (("pure_forward", lambda: model.model(input_ids=ids, attention_mask=att, use_cache=False)),
                     ("capture", lambda: target_features(model, ids, att, (2, 16, 29)))):
        with torch.inference_mode():
            for _ in range(2):
                fn()
            t0 = sync_time()
            for _ in range(batches):
                out = fn()
                if name == "capture":  # what capture does next: move to host memory for the store
                    out.aux.to("cpu", non_blocking=True), out.last.to("cpu", non_blocking=True)
            t1 = sync_time()
        res[name + "_tokens_per_s"] = seq * batches / (t1 - t0)
    res["ratio"] = res["capture_tokens_per_s"] / res["pure_forward_tokens_per_s"]
    res["seq"] = seq
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", default="2048,4096")
    ap.add_argument("--capture", action="store_true")
    ap.add_argument("--compile", action="store_true", help="torch.compile the drafter step")
    ap.add_argument("--profile", action="store_true", help="print the top CUDA kernels of one step")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/gpu_train.json"))
    args = ap.parse_args()
    result = {"command": " ".join(sys.argv), "date": datetime.date.today().isoformat(),
              "device": torch.cuda.get_device_name(), "torch": torch.__version__, "train": []}
    for seq in [int(s) for s in args.seq.split(",")]:
        try:
            r = bench_train(seq, compile_step=args.compile, profile=args.profile)
        except torch.OutOfMemoryError as exc:
            r = {"seq": seq, "error": f"OOM: {exc}"[:300]}
        torch.cuda.empty_cache()
        print(json.dumps(r), flush=True)
        result["train"].append(r)
    if args.capture:
        result["capture"] = bench_capture()
        print(json.dumps(result["capture"]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
