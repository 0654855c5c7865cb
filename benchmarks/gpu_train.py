"""GPU throughput of draftsmith's offline TTT training step and of capture, at Llama-3.1-8B shapes.

Randomly initialised models of real shapes, the settings of the SpecForge anchor
(../shared/anchors/specforge-bench): drafter hidden 4096, intermediate 14336, 32 / 8 heads, draft vocab 32,000,
target vocab 128,256, TTT 7, batch 1, bf16 autocast with fp32 master weights, AdamW, clip 0.5; 3 warm-up steps,
then 10 timed steps with the device synchronised before each clock read. `--trainer` runs the real Trainer
instead and times its steps queued as `draftsmith train`'s loop queues them (the next step launched before this
one's record is read; `--synced-steps` adds steps waited for one by one, `--trace-steps` a profile of where the GPU
waits).

FLOPs per token (counted from the step's shapes): 17.8 GFLOP for the TTT-7 step; MFU against 989 TFLOP/s dense bf16.

Run (on the GPU machine): python benchmarks/gpu_train.py --seq 2048,4096,8192 --capture --out results.json
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from draftsmith.model.eagle3 import DrafterConfig, Eagle3Drafter, compile_for_training, target_argmax, ttt_forward  # noqa: E402
from kernel_timeline import device_kernels, timeline  # noqa: E402

FLOP_PER_TOKEN = 17.8e9  # 7 TTT steps fwd+bwd through the layer and draft head, plus the target head
PEAK_BF16 = 989e12  # H100/H200 dense bf16 datasheet


def llama8b_drafter() -> DrafterConfig:
    return DrafterConfig(hidden_size=4096, intermediate_size=14336, num_heads=32, num_kv_heads=8, head_dim=128,
                         vocab_size=128256, draft_vocab_size=32000, target_hidden_size=4096, target_num_layers=32,
                         aux_layer_ids=(2, 16, 29), rms_norm_eps=1e-5, rope_theta=500000.0,
                         max_position_embeddings=131072)


def sync_time() -> float:
    torch.cuda.synchronize()
    return time.perf_counter()


def optimizer_step(drafter, opt, params, aux, ids, mask, last, head, ttt: int, t_argmax=None) -> None:
    """One TTT step as the trainer runs it: bf16 autocast forward, backward, clip 0.5, AdamW."""
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = ttt_forward(drafter, aux, ids, mask, last, head, steps=ttt, t_argmax=t_argmax)
    out.loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 0.5)
    opt.step()
    opt.zero_grad(set_to_none=True)


def bench_train(seq: int, steps: int = 10, warmup: int = 3, ttt: int = 7, compile_step: bool = False,
                profile: bool = False, profile_rows: int = 18) -> dict:
    dev = torch.device("cuda")
    torch.manual_seed(0)
    drafter = Eagle3Drafter(llama8b_drafter()).to(dev)
    if compile_step:
        compile_for_training(drafter)
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
    # The store holds the target's full-vocabulary argmax (capture computes it once per token), as the
    # trainer reads it; the step does not recompute it.
    t_argmax = target_argmax(last, head)
    torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(warmup + steps):
        t0 = sync_time()
        optimizer_step(drafter, opt, params, aux, ids, mask, last, head, ttt, t_argmax)
        t1 = sync_time()
        if i >= warmup:
            times.append(t1 - t0)
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = ttt_forward(drafter, aux, ids, mask, last, head, steps=ttt, t_argmax=t_argmax)
            out.loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=profile_rows, max_name_column_width=70))
    times.sort()
    step_s = times[len(times) // 2]
    tok_s = seq / step_s
    return {"seq": seq, "ttt": ttt, "compiled": compile_step, "tokens_per_s": tok_s, "step_ms": step_s * 1000,
            "peak_gb": torch.cuda.max_memory_allocated() / 1e9, "mfu": tok_s * FLOP_PER_TOKEN / PEAK_BF16,
            "trainable_params_m": sum(p.numel() for p in params) / 1e6}


def llama8b_target_config():
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
                       architectures=["LlamaForCausalLM"])


def qwen3_moe_target_config():
    """Qwen3-30B-A3B shapes: 48 layers, hidden 2048, 128 experts (8 active) of width 768, 32 / 4 heads."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                          head_dim=128, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                          intermediate_size=6144, vocab_size=151936, max_position_embeddings=40960,
                          architectures=["Qwen3MoeForCausalLM"])


def bench_capture(seq: int = 4096, batches: int = 5, moe: bool = False) -> dict:
    """Pure target forward against draftsmith's target_features (aux + final state) on the same batches."""
    from transformers import AutoModelForCausalLM

    from draftsmith.capture.local import target_features
    from draftsmith.target import describe_target

    cfg = qwen3_moe_target_config() if moe else llama8b_target_config()
    cfg._attn_implementation = "sdpa"
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg).eval()
    torch.set_default_dtype(torch.float32)
    aux_ids = describe_target(cfg.to_dict()).default_aux_ids
    ids = torch.randint(0, cfg.vocab_size, (1, seq), device="cuda")
    att = torch.ones_like(ids)
    res = {}
    for name, fn in (("pure_forward", lambda: model.model(input_ids=ids, attention_mask=att, use_cache=False)),
                     ("capture", lambda: target_features(model, ids, att, aux_ids))):
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
    res.update(seq=seq, model=cfg.architectures[0], params_b=sum(p.numel() for p in model.parameters()) / 1e9)
    return res


def bench_online(seq: int = 4096, steps: int = 6, warmup: int = 2) -> dict:
    """Online training: the Llama-3.1-8B-shaped target (bf16) and the drafter in one process; each step runs
    the target forward for the features, then the TTT-7 drafter step on them."""
    from transformers import LlamaForCausalLM

    from draftsmith.capture.local import target_features

    cfg = llama8b_target_config()
    cfg._attn_implementation = "sdpa"
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        target = LlamaForCausalLM(cfg).eval()
    torch.set_default_dtype(torch.float32)
    dev = torch.device("cuda")
    drafter = Eagle3Drafter(llama8b_drafter()).to(dev)
    drafter.d2t.copy_(torch.arange(32000, device=dev) * 3)
    drafter.t2d[torch.arange(32000, device=dev) * 4] = True
    head = target.get_output_embeddings().weight.detach()
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), fused=True)
    ids = torch.randint(0, 128256, (1, seq), device=dev)
    att, mask = torch.ones_like(ids), torch.ones_like(ids)
    torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(warmup + steps):
        t0 = sync_time()
        with torch.inference_mode():
            feats = target_features(target, ids, att, (2, 16, 29))
        optimizer_step(drafter, opt, params, feats.aux.clone(), ids, mask, feats.last.clone(), head, 7,
                       feats.target_argmax.clone())
        t1 = sync_time()
        if i >= warmup:
            times.append(t1 - t0)
    times.sort()
    step_s = times[len(times) // 2]
    return {"mode": "online", "seq": seq, "tokens_per_s": seq / step_s, "step_ms": step_s * 1000,
            "peak_gb": torch.cuda.max_memory_allocated() / 1e9}


class SyntheticSource:
    """Random features of Llama-3.1-8B shapes for the real Trainer (FeatureSource protocol), seeded per sample,
    so every rank and every run sees the same sample k."""

    def __init__(self, samples: int, seq: int, device: torch.device, dtype: torch.dtype | None = None):
        from draftsmith.target import describe_target

        cfg = llama8b_drafter()
        self.target_spec = describe_target(llama8b_target_config().to_dict())
        self.target_name, self.aux_ids, self.lengths = "synthetic-llama-3.1-8b", cfg.aux_layer_ids, [seq] * samples
        self.seq, self.device, self.dtype = seq, device, dtype
        self.V, self.H = self.target_spec.vocab_size, self.target_spec.hidden_size
        g = torch.Generator(device=device).manual_seed(0)
        self._head = (torch.randn(self.V, self.H, device=device, generator=g) * 0.02).to(torch.bfloat16)

    def __len__(self) -> int:
        return len(self.lengths)

    def batch(self, indices: list[int], device: torch.device):
        from draftsmith.train.features import Batch, feature_dtype

        out = []
        for k in indices:
            g = torch.Generator(device=device).manual_seed(1000 + k)
            dtype = self.dtype or feature_dtype(device)
            aux = torch.randn(1, self.seq, 3 * self.H, device=device, generator=g, dtype=dtype)
            last = torch.randn(1, self.seq, self.H, device=device, generator=g, dtype=dtype)
            ids = torch.randint(0, self.V, (1, self.seq), device=device, generator=g)
            out.append((ids, torch.ones_like(ids), aux, last, ids.roll(-1, 1)))
        return Batch(*(torch.cat(t) for t in zip(*out)))

    def target_head(self) -> torch.Tensor:
        return self._head

    def embed_tokens(self) -> torch.Tensor:
        return torch.randn(self.V, self.H, generator=torch.Generator().manual_seed(1)) * 0.02

    def token_counts(self) -> torch.Tensor:
        return torch.randint(0, 1000, (self.V,), generator=torch.Generator().manual_seed(2))


def bench_trainer(args) -> None:
    """The real `draftsmith train` loop (DDP or FSDP2 under torchrun) on synthetic Llama-3.1-8B features.

    Prints one JSON line (rank 0): per-step losses and tokens/s (median over steps after the warm-up)."""
    import os

    from draftsmith.train.settings import TrainConfig
    from draftsmith.train.trainer import Trainer

    world = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = args.device == "cuda"
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device(args.device)
    if cuda:
        torch.cuda.set_device(device)
    cfg = TrainConfig(out=f"/tmp/bench_trainer_{args.parallel}_{world}_{args.grad_accum}", store="<synthetic>", recipe="plain",
                      draft_vocab_size=llama8b_drafter().draft_vocab_size, lr=1e-4, warmup_ratio=0.0, clip=args.clip, batch_tokens=args.seq,
                      grad_accum=args.grad_accum, max_steps=args.steps + (args.trace_steps if cuda else 0), eval_fraction=0.0, eval_every=10**9,
                      save_every=10**9, log_every=10**9, parallel=args.parallel, device=str(device),
                      compile=args.compile, pack=False)  # fixed-length samples: the unpacked (cuDNN) path
    import shutil

    shutil.rmtree(cfg.out, ignore_errors=True)
    trainer = Trainer(cfg, data=SyntheticSource(cfg.max_steps * world * args.grad_accum + 8, args.seq, device,
                                                torch.float32 if args.fp32 else None))
    if args.fp32:  # no bf16 autocast: isolates rounding of bf16 GEMMs from the parallel scheme in parity runs
        trainer.autocast = False
        trainer.target_head = trainer.target_head.float()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    warm = min(3, trainer.total_steps)
    records = synced_steps(trainer, warm)  # the first compiles
    synced = synced_steps(trainer, args.synced_steps) if args.synced_steps else []
    trace_n = args.trace_steps if cuda else 0
    records += synced + pipelined_steps(trainer, trainer.total_steps - trainer.step - trace_n)
    timed = records[warm + len(synced):]
    trace = trace_steps(trainer, trace_n) if trace_n else None
    if trainer.rank == 0:
        ms = statistics.median_high(r["ms"] for r in timed)
        tokens = records[-1]["tokens"]
        record = {"mode": "trainer", "parallel": args.parallel if world > 1 else "single", "world": world,
                  "compiled": args.compile, "fp32": args.fp32,
                  "grad_accum": args.grad_accum, "seq": args.seq, "step_ms": ms,
                  "timing": "pipelined as draftsmith train's loop: step n+1 queued before step n is read",
                  "step_ms_synced": statistics.median_high(r["ms"] for r in synced) if synced else None,
                  "tokens_per_s": tokens / ms * 1000, "tokens_per_s_per_gpu": tokens / ms * 1000 / world,
                  "peak_gb_rank0": torch.cuda.max_memory_allocated() / 1e9 if cuda else None,
                  "losses": [round(r["loss"], 6) for r in records],
                  "grad_norms": [round(r["grad_norm"], 6) for r in records], "trace": trace}
        print(json.dumps(record), flush=True)
        if args.out:
            write_json(args.out, record)
    trainer.close()


def write_json(path: Path, result: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")


def synced_steps(trainer, n: int) -> list[dict]:
    """n steps, each waited for before the next is queued (`Trainer.train_step`): a step's time includes the
    host's work before its first kernel."""
    records = []
    for _ in range(n):
        records.append(trainer.train_step())
        trainer.step += 1
    return records


def pipelined_steps(trainer, n: int) -> list[dict]:
    """n steps the way `Trainer.run` queues them: step n+1 is launched before step n's record is read (the
    step's one sync), so the host prepares the next step while the GPU runs this one; a step's time is the
    loop's period (launch to next launch)."""
    records, pending = [], None
    for _ in range(n):
        launched = trainer.launch_step()
        trainer.step += 1
        if pending is not None:
            records.append(pending.resolve(end=launched.t0))
        pending = launched
    if pending is not None:
        records.append(pending.resolve())
    return records


def trace_steps(trainer, n: int) -> dict:
    """torch.profiler (CPU and CUDA) over n pipelined steps: the GPU's busy time per step against the loop's
    period, its idle gaps (the longest, with the host ops that ran during each) and kernel time by kind. The
    profile is extra: its failure is reported in the result instead of losing the timed figures."""
    try:
        return profiled_steps(trainer, n)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"[:400]}


def gemm_by_shape(host: list, n: int) -> dict | str:
    """GPU time of the matmul ops per step, by op and input shapes (the kernels each host op launched)."""
    try:
        out: dict[str, float] = {}
        for e in host:
            if e.name in ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_mm"):
                ms = sum(k.duration for k in e.kernels) / 1000
                if ms:
                    key = f"{e.name} {e.input_shapes}"[:120]
                    out[key] = out.get(key, 0.0) + ms / n
        return {k: round(v, 3) for k, v in sorted(out.items(), key=lambda kv: -kv[1])[:40]}
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"[:200]


def profiled_steps(trainer, n: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        records = pipelined_steps(trainer, n)
        torch.cuda.synchronize()
    events = prof.events()
    kernels = device_kernels(events)
    summary = timeline(kernels, n)
    if "error" in summary:
        return summary
    gaps = summary.pop("gaps")
    host = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU and e.time_range.end > e.time_range.start]

    def during(s: float, e: float) -> list[str]:
        names: list[str] = []
        for h in sorted((h for h in host if h.time_range.start < e and h.time_range.end > s),
                        key=lambda h: -(h.time_range.end - h.time_range.start)):
            if h.name not in names:
                names.append(h.name)
        return names[:6]

    return {"period_ms": [round(r["ms"], 2) for r in records], **summary,
            "gemm_ms_per_step_by_shape": gemm_by_shape(host, n),
            "longest_gaps": [{"ms": round(ms, 3), "at_ms": round((s - kernels[0].start_us) / 1000, 2),
                              "host_ops": during(s, e)} for ms, s, e in gaps[:12]]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", default="2048,4096")
    ap.add_argument("--capture", action="store_true")
    ap.add_argument("--capture-moe", action="store_true", help="capture vs forward on a Qwen3-30B-A3B-shaped MoE")
    ap.add_argument("--online", action="store_true", help="online training: 8B-shaped target + drafter in one process")
    ap.add_argument("--compile", action="store_true", help="torch.compile the drafter step and loss pass")
    ap.add_argument("--profile", action="store_true", help="print the top CUDA kernels of one step")
    ap.add_argument("--profile-rows", type=int, default=18, help="rows of the --profile table")
    ap.add_argument("--out", type=Path, default=None,
                    help="the JSON file (default benchmarks/results/gpu_train.json; --trainer: written only if given)")
    ap.add_argument("--trainer", action="store_true",
                    help="run the real Trainer loop (use under torchrun for DDP / FSDP2); prints one JSON line, also "
                         "written to --out")
    ap.add_argument("--parallel", default="ddp")
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--clip", type=float, default=0.5, help="trainer mode: gradient-norm clip")
    ap.add_argument("--fp32", action="store_true", help="trainer mode without bf16 autocast (parity checks)")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run of the trainer mode")
    ap.add_argument("--synced-steps", type=int, default=0,
                    help="trainer mode: also time this many steps waited for one by one (before the pipelined ones)")
    ap.add_argument("--trace-steps", type=int, default=0,
                    help="trainer mode, CUDA: profile this many pipelined steps after the timed ones (GPU busy and "
                         "idle time, the longest idle gaps with the host ops during them, kernel time by kind)")
    args = ap.parse_args()
    if args.trainer:
        args.seq = int(args.seq.split(",")[0])
        return bench_trainer(args)
    result = {"command": " ".join(sys.argv), "date": datetime.date.today().isoformat(),
              "device": torch.cuda.get_device_name(), "torch": torch.__version__, "train": []}
    for seq in [int(s) for s in args.seq.split(",") if s.isdigit()]:
        try:
            r = bench_train(seq, compile_step=args.compile, profile=args.profile, profile_rows=args.profile_rows)
        except torch.OutOfMemoryError as exc:
            r = {"seq": seq, "error": f"OOM: {exc}"[:300]}
        torch.cuda.empty_cache()
        print(json.dumps(r), flush=True)
        result["train"].append(r)
    if args.capture:
        result["capture"] = bench_capture()
        print(json.dumps(result["capture"]), flush=True)
    if args.capture_moe:
        torch.cuda.empty_cache()
        result["capture_moe"] = bench_capture(moe=True, batches=3)
        print(json.dumps(result["capture_moe"]), flush=True)
    if args.online:
        torch.cuda.empty_cache()
        result["online"] = bench_online()
        print(json.dumps(result["online"]), flush=True)
    write_json(args.out or Path("benchmarks/results/gpu_train.json"), result)


if __name__ == "__main__":
    main()
