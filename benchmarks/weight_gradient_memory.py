"""Peak memory of the compiled training step with `kernels.one_product_per_sum` on and off, measured on the CPU at
Llama-3.1-8B drafter shapes scaled down.

The pass keeps every TTT step's output gradients alive until one product per weight, where autograd would free
each after its own product (docs/gpu.md, session 34's paragraph on the pass): it can raise the step's peak. What
that costs on a GPU needs a GPU; this measures the same compiled graphs' memory on the CPU, where inductor plans
buffers the same way but fuses differently (its C++ kernels), so the figure is evidence, not the GPU's number.

All sizes are the 8B drafter's divided by --scale (hidden, intermediate, head dim, both vocabularies, sequence), so
the weights and the activations shrink alike and the ratio of the two peaks is the figure to read. Each setting
runs in a process of its own (the pass is compiled in): one warm-up step (compiles; the gradients are allocated),
then one step under torch.profiler with memory profiling, whose allocations and frees in order give the live bytes
over the step; the peaks (the step's, the forward's, the backward's) are reported above the live bytes at the step's
start, with the matrix products the step ran.

    python benchmarks/weight_gradient_memory.py --scale 8 --out benchmarks/results/weight_gradient_memory_cpu.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from draftsmith.model import kernels# noqa: E402
from draftsmith.model.eagle3 import DrafterConfig, ttt_forward  # noqa: E402
from gpu_train import weight_gradient_setting  # noqa: E402
from weight_gradient_graph import compiled_step_inputs  # noqa: E402

SETTINGS = ("off", "on")  # the pass, with no row cap: every step's rows merged at once


def scaled_config(scale: int) -> DrafterConfig:
    """Llama-3.1-8B's drafter shapes (benchmarks/gpu_train.py's llama8b_drafter) divided by `scale`."""
    return DrafterConfig(hidden_size=4096 // scale, intermediate_size=14336 // scale, num_heads=32, num_kv_heads=8,
                         head_dim=128 // scale, vocab_size=128256 // scale, draft_vocab_size=32000 // scale,
                         target_hidden_size=4096 // scale, target_num_layers=32, aux_layer_ids=(2, 16, 29),
                         rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=131072)


def live_bytes(prof) -> dict:
    """Live bytes over the profiled step, relative to its start: the step's peak, the forward's and the backward's
    (from the "backward" range on), the net at the end, and the backward's peak in each tenth of its allocations and
    frees (where in the backward the memory sits). Read from torch.profiler's memory timeline (each tensor's
    creation and destruction in order; `_memory_profile` is private, the one API that pairs them), not from the ops'
    memory figures, which count an allocation once per op that encloses it."""
    from torch.profiler._memory_profiler import Action

    start_ns = prof.profiler.kineto_results.trace_start_ns()
    backward_ns = start_ns + 1000 * next(e for e in prof.events() if e.name == "backward").time_range.start
    live, peaks, curve = 0, {"forward": 0, "backward": 0}, []
    for t, action, _, size in prof._memory_profile().timeline:
        if action not in (Action.CREATE, Action.DESTROY):
            continue  # tensors alive before the step, and in-place writes
        live += size if action == Action.CREATE else -size
        part = "backward" if t >= backward_ns else "forward"
        peaks[part] = max(peaks[part], live)
        if part == "backward":
            curve.append(live)
    tenths = [max(curve[i * len(curve) // 10:(i + 1) * len(curve) // 10] or [0]) for i in range(10)]
    return {"step_peak_bytes": max(peaks.values()), "forward_peak_bytes": peaks["forward"],
            "backward_peak_bytes": peaks["backward"], "step_end_bytes": live, "backward_peak_by_tenth": tenths}


def measure(setting: str, scale: int, steps: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    weight_gradient_setting(setting == "on", None)
    cfg = scaled_config(scale)
    drafter, batch = compiled_step_inputs(cfg, 4096 // scale)

    def step() -> float:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = ttt_forward(drafter, *batch, steps=steps)
        with torch.profiler.record_function("backward"):
            out.loss.backward()
        return float(out.loss)

    t0 = time.perf_counter()
    step()  # compiles; allocates the gradients, which the next step accumulates into
    first_s = time.perf_counter() - t0
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        t0 = time.perf_counter()
        loss = step()
        step_s = time.perf_counter() - t0
    products = sum(1 for e in prof.events() if e.name in ("aten::mm", "aten::addmm"))
    params = sum(p.numel() * p.element_size() for p in drafter.parameters())
    return {"setting": setting, "pass": kernels.WEIGHT_GRADIENT_PASS, "loss": loss, "first_step_s": first_s,
            "step_s": step_s, "matrix_products": products, **live_bytes(prof), "parameter_bytes": params}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", type=int, default=8, help="divide the 8B drafter's sizes and the sequence by this")
    ap.add_argument("--steps", type=int, default=7, help="TTT steps")
    ap.add_argument("--settings", default="off,on", help=f"which of {sorted(SETTINGS)}, in order")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a child process: measure this setting
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args.scale, args.steps)), flush=True)
        return
    runs = []
    for setting in args.settings.split(","):
        if setting not in SETTINGS:
            raise SystemExit(f"unknown setting {setting!r}: expected one of {sorted(SETTINGS)}")
        done = subprocess.run([sys.executable, __file__, "--one", setting, "--scale", str(args.scale),
                               "--steps", str(args.steps)], capture_output=True, text=True)
        lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
        runs.append(json.loads(lines[-1]) if done.returncode == 0 and lines else
                    {"setting": setting, "error": f"rc {done.returncode}: {done.stderr[-600:]}"})
        print(json.dumps(runs[-1]), flush=True)
    result = {"what": __doc__.splitlines()[0], "command": " ".join(sys.argv), "date": str(datetime.date.today()),
              "torch": torch.__version__, "scale": args.scale, "tokens": 4096 // args.scale, "steps": args.steps,
              "runs": runs}
    by = {r["setting"]: r for r in runs if "error" not in r}
    if "on" in by and "off" in by:
        for part in ("step", "forward", "backward"):
            result[f"{part}_peak_on_over_off"] = by["on"][f"{part}_peak_bytes"] / by["off"][f"{part}_peak_bytes"]
        result["loss_on_minus_off"] = by["on"]["loss"] - by["off"]["loss"]
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
