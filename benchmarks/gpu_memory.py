"""Where a training step's peak GPU memory goes: draftsmith's Trainer and SpecForge's step, one call.

For each implementation: build at Llama-3.1-8B drafter shapes (the settings of benchmarks/gpu_train.py and
of the SpecForge anchor, ../shared/anchors/specforge-bench), run warm-up steps, then record the CUDA
allocator's history over one step (torch.cuda.memory._record_memory_history) and replay it: the peak of
allocated bytes, and the allocations live at that moment grouped by the innermost frame of project code
(draftsmith, SpecForge or this driver). What was allocated before the recorded step (weights, optimizer
state, inputs) is reported by kind from the tensors themselves.

SpecForge's side calls the anchor driver's own build / make_batch / train_step (its math is SpecForge's,
imported from the anchor's `src/`; nothing of it is copied here).

Run (on the GPU machine, the anchor set up as in its RUN.md under anchors/specforge):
    python3 benchmarks/gpu_memory.py --seq 4096 --impl draftsmith,specforge --out $OUT/gpu_memory.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

GB = 1e9
PROJECT_MARKERS = ("/draftsmith/", "/specforge/", "gpu_memory.py", "bench.py")


def tensor_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None or not t.is_cuda:
            continue
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def frame_key(frames: list[dict]) -> str:
    """The innermost frame in project code: 'file:line function'."""
    for f in frames:
        name = f.get("filename", "")
        if any(m in name for m in PROJECT_MARKERS) and "_record_memory_history" not in f.get("name", ""):
            return f"{Path(name).name}:{f.get('line')} {f.get('name')}"
    return frames[0]["name"] if frames else "?"


def peak_of_trace(snapshot: dict, top: int = 25) -> dict:
    """Replay the recorded allocator events: the peak of live bytes and what was live there, by frame."""
    events = [e for trace in snapshot["device_traces"] for e in trace]
    live: dict[int, tuple[int, str]] = {}
    cur = peak = peak_index = 0
    for i, e in enumerate(events):
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], None)
            cur += e["size"]
            if cur > peak:
                peak, peak_index = cur, i
        elif e["action"] == "free_completed" and e["addr"] in live:
            cur -= live.pop(e["addr"])[0]
    live.clear()
    for e in events[:peak_index + 1]:
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], frame_key(e.get("frames", [])))
        elif e["action"] == "free_completed":
            live.pop(e["addr"], None)
    groups: dict[str, int] = defaultdict(int)
    for size, key in live.values():
        groups[key] += size
    at_peak = events[peak_index] if events else {}
    ranked = sorted(groups.items(), key=lambda kv: -kv[1])
    return {"step_peak_gb": peak / GB, "peak_at": frame_key(at_peak.get("frames", [])),
            "live_at_peak_gb": {k: round(v / GB, 3) for k, v in ranked[:top]},
            "rest_gb": round(sum(v for _, v in ranked[top:]) / GB, 3)}


def record_one_step(step, warmup: int) -> dict:
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=500_000, stacks="python")
    step()
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    trace = peak_of_trace(snapshot)
    return {"allocated_before_step_gb": before / GB, "max_allocated_gb": torch.cuda.max_memory_allocated() / GB,
            **trace}


def draftsmith_step(seq: int, compile_step: bool, grad_accum: int):
    from gpu_train import SyntheticSource, llama8b_drafter

    from draftsmith.train.settings import TrainConfig
    from draftsmith.train.trainer import Trainer

    device = torch.device("cuda")
    out = tempfile.mkdtemp(prefix="gpu_memory_")
    cfg = TrainConfig(out=out, store="<synthetic>", recipe="plain", draft_vocab_size=llama8b_drafter().draft_vocab_size, lr=1e-4,
                      warmup_ratio=0.0, clip=0.5, batch_tokens=seq, grad_accum=grad_accum, max_steps=100,
                      eval_fraction=0.0, eval_every=10**9, save_every=10**9, log_every=10**9, device="cuda",
                      compile=compile_step, pack=False)
    trainer = Trainer(cfg, data=SyntheticSource(100 * grad_accum + 8, seq, device))

    def step():
        trainer.train_step()
        trainer.step += 1

    def kinds() -> dict:
        params = list(trainer.drafter.parameters())
        return {"params_trainable_gb": tensor_bytes(p for p in params if p.requires_grad) / GB,
                "params_frozen_gb": tensor_bytes(p for p in params if not p.requires_grad) / GB,
                "target_head_gb": tensor_bytes([trainer.target_head]) / GB,
                "optimizer_state_gb": tensor_bytes(t for s in trainer.optimizer.state.values() for t in s.values()
                                                   if torch.is_tensor(t)) / GB}
    return step, kinds, lambda: (trainer.close(), shutil.rmtree(out, ignore_errors=True))


def specforge_step(seq: int, anchor: Path):
    sys.path.insert(0, str(anchor))
    import bench as sf  # the anchor's driver: SpecForge's own model, loss and optimizer

    device, dtype = torch.device("cuda"), torch.bfloat16
    tmp = tempfile.mkdtemp(prefix="gpu_memory_sf_")
    cfg = sf.LLAMA31_8B_DRAFT
    model, head, strategy, opt = sf.build(cfg, "flex_attention", 7, device, dtype, tmp)
    gen = torch.Generator().manual_seed(0)
    batch = sf.make_batch(cfg, 1, seq, device, dtype, gen)

    def step():
        sf.train_step(strategy, opt, batch)

    def kinds() -> dict:
        params = list(model.parameters())
        return {"params_trainable_gb": tensor_bytes(p for p in params if p.requires_grad) / GB,
                "params_frozen_gb": tensor_bytes(p for p in params if not p.requires_grad) / GB,
                "target_head_gb": tensor_bytes(head.parameters()) / GB}
    return step, kinds, lambda: shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--impl", default="draftsmith,specforge")
    ap.add_argument("--no-compile", action="store_true", help="draftsmith eager (default: compiled, as benchmarked)")
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--anchor", type=Path, default=ROOT / "anchors" / "specforge")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    result = {"what": __doc__.splitlines()[0], "command": " ".join(sys.argv), "date": str(datetime.date.today()),
              "device": torch.cuda.get_device_name(), "torch": torch.__version__, "seq": args.seq, "runs": []}
    for impl in [s.strip() for s in args.impl.split(",") if s.strip()]:
        torch.cuda.empty_cache()
        if impl == "draftsmith":
            step, kinds, close = draftsmith_step(args.seq, not args.no_compile, args.grad_accum)
        elif impl == "specforge":
            step, kinds, close = specforge_step(args.seq, args.anchor)
        else:
            raise SystemExit(f"unknown --impl {impl!r}; expected draftsmith or specforge")
        try:
            record = {"impl": impl, **record_one_step(step, args.warmup), **kinds()}
        except Exception as exc:  # noqa: BLE001 - one failing side must not lose the other's figures
            record = {"impl": impl, "error": f"{type(exc).__name__}: {exc}"[:500]}
        close()
        print(json.dumps(record), flush=True)
        result["runs"].append(record)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    os._exit(0)  # SpecForge's and the compiler's worker threads: no teardown to wait for


if __name__ == "__main__":
    main()
