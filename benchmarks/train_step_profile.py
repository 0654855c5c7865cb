"""Where the time of one `Trainer.train_step` goes at a small drafter's shapes (SmolLM2-135M: hidden 576).

At SmolLM2's size a step is far from GEMM-bound: speculators' compiled loop ran 2.1x draftsmith's steps per
second at the same settings on one H200 (docs/peers.md). This runs the real Trainer on random features of
SmolLM2's shapes, packed from lengths drawn from the committed histogram of the embedded drafter's data, for
each named setting, and reports per setting: the median step (wall, end-of-step sync included), the GPU's busy
time in the step (the union of its kernels' spans, from torch.profiler: kernel_timeline.py), the kernels per step, the
host's CUDA calls per step (eager kernel launches, CUDA graph launches, copies: count and CPU ms), the top kernels
and CPU-side ops, and with --compile torch.compile's graph and graph-break counts. wall - busy is what launches,
host work and syncs cost.

Compiled settings of different shapes in one process share dynamo's cache: the second shape recompiles with
dynamic shapes, which is not what a run of that shape alone compiles. scripts/device/device_step_profile.sh runs each
setting in a process of its own.

`--host` builds every batch as the store reader does: samples on the CPU (a pool of real-length tensors),
packed there, then copied; without it, samples are made on the device (the step alone).

Settings are `NAME` or `NAME:field=value,field=value` over TrainConfig's fields (`default` is TrainConfig's
defaults; `+compile` etc. are plain fields: `default-compile:compile=true`):

    python benchmarks/train_step_profile.py --device cuda --host \
        --setting default --setting matched:ttt_steps=3,batch_tokens=8192,draft_vocab_size=49152,step_loss_decay=1.0 \
        --out /tmp/profile.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_packing import LengthSource, draw_lengths, load_histogram  # noqa: E402
from draftsmith.capture.store import Sample  # noqa: E402
from kernel_timeline import device_kernels, timeline  # noqa: E402

HISTOGRAM = Path(__file__).parent / "results" / "length_histogram_smollm2_self.json"


def smollm2_config():
    """SmolLM2-135M-Instruct's shapes (its config.json): 30 layers, hidden 576, 9 / 3 heads, vocab 49,152."""
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                       num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0,
                       rms_norm_eps=1e-5, tie_word_embeddings=True, architectures=["LlamaForCausalLM"])


class HostSource(LengthSource):
    """LengthSource whose samples live on the CPU, as a memory-mapped store's do: views of a small pool of
    full-length random tensors (the values do not matter, the copies do)."""

    POOL = 16

    def __init__(self, lengths, target_config, aux_ids, device):
        super().__init__(lengths, target_config, aux_ids, device)
        dtype, n = torch.bfloat16 if device.type == "cuda" else torch.float32, max(lengths)
        g = torch.Generator().manual_seed(0)
        self.pool = [(torch.randint(0, self.V, (n,), generator=g), torch.randn(n, 3 * self.H, generator=g).to(dtype),
                      torch.randn(n, self.H, generator=g).to(dtype)) for _ in range(self.POOL)]

    def sample(self, k: int, device: torch.device) -> Sample:
        ids, aux, last = self.pool[k % self.POOL]
        n = self.lengths[k]
        return Sample(ids[:n], self.loss_mask(k), aux[:n], last[:n], ids[:n].roll(-1))

    def packed_batch(self, rows, row_tokens: int, device: torch.device):
        from draftsmith.train.features import feature_dtype, pack_rows

        return pack_rows(rows, row_tokens, lambda k: self.sample(k, torch.device("cpu")), device, feature_dtype(device))


def parse_setting(text: str) -> tuple[str, dict]:
    from draftsmith.train.settings import TrainConfig

    name, _, rest = text.partition(":")
    fields = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        if key not in TrainConfig.model_fields:
            raise SystemExit(f"unknown TrainConfig field {key!r} in --setting {text!r}")
        try:
            fields[key] = json.loads(value) if value not in ("", None) else None
        except json.JSONDecodeError:  # a bare word: recipe=normed
            fields[key] = value
    return name, fields


HOST_CALLS = {"eager_kernel_launches": "cudaLaunchKernel", "graph_launches": "cudaGraphLaunch",
              "copies": "cudaMemcpyAsync"}
"""The CUDA runtime calls that are the step's host work, by what they mean: each eager kernel is one launch, each
CUDA graph replay one graph launch, each copy into a graph's static inputs (or from the host) one memcpy."""


def dynamo_counts() -> dict:
    """torch.compile's graphs and graph breaks so far in this process (a break splits the compiled forward)."""
    from torch._dynamo.utils import counters

    return {"unique_graphs": counters["stats"]["unique_graphs"],
            "graph_breaks": sum(counters["graph_break"].values()),
            "graph_break_reasons": sorted(counters["graph_break"])[:10]}


def kernel_summary(prof, steps: int, top: int) -> dict:
    """Kernels and GPU busy time per step (kernel_timeline's summary), the host's CUDA calls, the top CPU-side ops."""
    summary = timeline(device_kernels(prof.events()), steps, top)
    summary.pop("gaps", None)
    averages = prof.key_averages()
    cpu = sorted(((e.self_cpu_time_total, e.count, e.key[:90]) for e in averages), reverse=True)[:top]
    host = {e.key: e for e in averages if e.key in HOST_CALLS.values()}
    return {**summary,
            "host_calls_per_step": {name: {"calls": host[key].count / steps if key in host else 0.0,
                                           "self_ms": host[key].self_cpu_time_total / 1000 / steps if key in host else 0.0}
                                    for name, key in HOST_CALLS.items()},
            "top_cpu_ops": [{"name": n, "self_ms_per_step": t / 1000 / steps, "calls_per_step": c / steps}
                            for t, c, n in cpu]}


def measure(args, lengths: list[int], name: str, fields: dict) -> dict:
    from draftsmith.train.settings import TrainConfig
    from draftsmith.train.trainer import Trainer

    device = torch.device(args.device)
    out = Path(tempfile.mkdtemp(prefix="train_profile_"))
    cfg = TrainConfig(**{"out": str(out), "store": "<synthetic>", "recipe": "plain", "warmup_ratio": 0.0, "eval_fraction": 0.0,
                         "device": str(device), "max_steps": args.warmup + 2 * args.steps + args.profile_steps,
                         **fields})
    source = (HostSource if args.host else LengthSource)(lengths, smollm2_config(), (2, 15, 27), device)
    trainer = Trainer(cfg, data=source)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    records = []
    for _ in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        records.append(trainer.train_step())  # ends in its own CPU-GPU sync
        records[-1]["wall_s"] = time.perf_counter() - t0
        trainer.step += 1
    timed = records[args.warmup:]
    step_ms = statistics.median(r["wall_s"] for r in timed) * 1000
    result = {"setting": name, "fields": fields, "row_tokens": trainer.row_tokens if cfg.pack else None,
              "rows_per_batch": trainer.rows_per_batch if cfg.pack else None, "shape": records[-1]["shape"],
              "first_step_s": records[0]["wall_s"], "step_ms_median": step_ms,
              "slot_tokens_per_s": statistics.median(r["tokens"] / r["wall_s"] for r in timed),
              "useful_tokens_per_s": sum(r["real_tokens"] for r in timed) / sum(r["wall_s"] for r in timed),
              "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None}
    # The loop's way (Trainer.run): step n+1 is queued before step n's statistics are read, so no sync sits
    # between two steps; the time per step is the wall over `steps` of them.
    t0, pending, loop = time.perf_counter(), None, []
    for _ in range(args.steps):
        launched = trainer.launch_step()
        trainer.step += 1
        if pending is not None:
            loop.append(pending.resolve(end=launched.t0)["ms"])  # launch to next launch
        pending = launched
    pending.resolve()
    result["pipelined_step_ms"] = (time.perf_counter() - t0) * 1000 / args.steps
    # the mean above counts every stall; the median is the like of step_ms_median (the last step has no successor)
    result["pipelined_step_ms_median"] = statistics.median(loop) if loop else None
    result["pipelined_slot_tokens_per_s"] = records[-1]["tokens"] / result["pipelined_step_ms"] * 1000
    if args.profile_steps:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=acts) as prof:
            t0 = time.perf_counter()
            for _ in range(args.profile_steps):
                trainer.train_step()
                trainer.step += 1
            profiled_ms = (time.perf_counter() - t0) * 1000 / args.profile_steps
        result["profiled_step_ms"] = profiled_ms
        if cuda:
            result.update(kernel_summary(prof, args.profile_steps, args.top))
    if cfg.compile:
        result["dynamo"] = dynamo_counts()  # cumulative over the settings run before this one in the process
    trainer.close()
    shutil.rmtree(out, ignore_errors=True)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--setting", action="append", default=None, help="NAME[:field=value,...] (repeatable)")
    ap.add_argument("--histogram", type=Path, default=HISTOGRAM)
    ap.add_argument("--samples", type=int, default=4000)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--host", action="store_true", help="samples on the CPU, packed there and copied (the store's way)")
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--profile-steps", type=int, default=3)
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    lengths = draw_lengths(load_histogram(args.histogram), args.samples, seed=0)
    runs = []
    for text in args.setting or ["default"]:
        name, fields = parse_setting(text)
        r = measure(args, lengths, name, fields)
        runs.append(r)
        print(f"{name}: {r['step_ms_median']:.1f} ms/step waited (median), {r['pipelined_step_ms']:.1f} pipelined (mean; "
              f"median {r['pipelined_step_ms_median'] or float('nan'):.1f}), "
              f"{r['slot_tokens_per_s']:,.0f} tok/s, first "
              f"{r['first_step_s']:.1f} s" + (f", GPU busy {r['gpu_busy_ms_per_step']:.1f} ms, "
                                               f"{r['kernels_per_step']:.0f} kernels/step, host calls/step "
                                               + ", ".join(f"{k} {v['calls']:.0f} ({v['self_ms']:.2f} ms)"
                                                           for k, v in r["host_calls_per_step"].items())
                                               if "kernels_per_step" in r else ""),
              flush=True)
        args.out.write_text(json.dumps({"what": "Trainer.train_step at SmolLM2 shapes: wall, GPU busy, launches",
                                        "command": " ".join(sys.argv), "date": str(datetime.date.today()),
                                        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
                                        "torch": torch.__version__, "host": args.host, "runs": runs}, indent=2) + "\n")


if __name__ == "__main__":
    main()
