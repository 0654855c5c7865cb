"""draftsmith's Trainer beside SpecForge's training step on one GPU, in one run (docs/gpu-results.md).

Four measurements, each in a fresh process, at Llama-3.1-8B drafter shapes, TTT 7, bf16:
1. SpecForge (the anchor driver, ../shared/anchors/specforge-bench, set up under anchors/specforge as its
   RUN.md says) at batch 1, its default, on a grid of sequence lengths (4096 included): step time and peak
   memory per length.
2. draftsmith's Trainer at a fixed 4096 tokens per step (gpu_train.py --trainer --compile), grad-accum 1, its
   steps queued as `draftsmith train` queues them: the fixed-length ratio and the memory beside SpecForge's 4096
   figures. SpecForge's driver waits for each step, as its own loop does: its step controller reads the step's
   metrics and gradient norm on the host (.tolist(), .item() in `_result`, a6b6b02) at the end of every step.
3. draftsmith's Trainer on lengths drawn from a real length histogram (bench_packing.py run: packed rows of
   4096 with document masks, and unpacked micro-batches of at most 4096 tokens padded to their longest), one
   step of each micro-batch shape first (compiles), then the timed steps.
4. SpecForge on the same drawn lengths: batch 1 per conversation, each one's step time read off the grid
   (linear between grid points; a floor where each length takes the grid point at or below it, which can
   only flatter SpecForge). Useful tokens/s = the conversations' tokens / the summed step times.

Run (on the GPU machine; carry `anchors`):
    python3 benchmarks/specforge_compare.py --out $OUT/specforge_compare.json
"""

from __future__ import annotations

import argparse
import bisect
import datetime
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from gpu import json_lines  # noqa: E402  (the suites' JSON-line reader)
GRID = (256, 512, 1024, 2048, 3072, 4096)


def run(cmd: list[str], cwd: Path, timeout: int, log: Path) -> tuple[list[dict], float]:
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)
        stdout, stderr = p.stdout, p.stderr
    except subprocess.TimeoutExpired as exc:
        stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        stderr = f"timed out after {timeout} s\n" + (exc.stderr.decode() if isinstance(exc.stderr, bytes)
                                                     else (exc.stderr or ""))
    log.write_text(f"$ {' '.join(cmd)}\n--- stdout\n{stdout}\n--- stderr\n{stderr[-20000:]}\n")
    return json_lines(stdout), time.perf_counter() - t0


def step_seconds(grid: dict[int, float], n: int, floor: bool) -> float:
    """SpecForge's step time at length n from its grid: linear between the points around n (floor: the point at
    or below n). Below the first point, proportional to n (either way, the lowest time it could be)."""
    xs = sorted(grid)
    i = bisect.bisect_right(xs, n)  # xs[i-1] <= n < xs[i]
    if i == 0:
        return grid[xs[0]] * n / xs[0]
    if floor or i == len(xs):
        return grid[xs[i - 1]]
    x0, x1 = xs[i - 1], xs[i]
    return grid[x0] + (grid[x1] - grid[x0]) * (n - x0) / (x1 - x0)


def specforge_run(py: str, args, seqs: str, log: Path) -> tuple[list[dict], float]:
    """SpecForge's own step through the anchor driver at `seqs`, in a fresh process (flex attention, its default)."""
    return run([py, "bench.py", "--device", "cuda", "--seqs", seqs, "--backends", "flex_attention",
                "--budget-s", str(args.specforge_budget_s)], args.anchor, args.specforge_budget_s + 150, log)


def fixed_ratio(tokens_per_s: float, peak_gb: float, sf: dict) -> dict:
    """draftsmith's fixed-4096 figure against SpecForge's row at 4096, with the issue's two goals."""
    return {"draftsmith_tokens_per_s": tokens_per_s, "specforge_tokens_per_s": sf["tokens_per_s"],
            "ratio": tokens_per_s / sf["tokens_per_s"], "goal_ratio": 1.5,
            "draftsmith_peak_gb": peak_gb, "specforge_peak_gb": sf["peak_mem_gb"],
            "memory_goal": "draftsmith <= SpecForge"}


def main() -> None:
    from bench_packing import draw_lengths, load_histogram

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--histogram", type=Path, default=ROOT / "benchmarks/results/length_histogram_smollm2_self.json")
    ap.add_argument("--scale-max", type=int, default=4096)
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--steps", type=int, default=10, help="draftsmith: timed steps per mode")
    ap.add_argument("--grid", default=",".join(map(str, GRID)))
    ap.add_argument("--anchor", type=Path, default=ROOT / "anchors" / "specforge")
    ap.add_argument("--specforge-budget-s", type=int, default=400, help="SpecForge skips lengths after this long")
    ap.add_argument("--real-limit-s", type=int, default=560,
                    help="draftsmith's real-length run stops after this; bench_packing writes packed before unpacked")
    ap.add_argument("--skip", default="", help="comma list of parts to skip: specforge, fixed, real")
    ap.add_argument("--cuda-graphs", action="store_true",
                    help="also the Trainer with --compile --cuda-graphs: at fixed 4096 (rows of one 4096-token "
                         "document, packed, so one shape) beside the plain compiled figure, and for the packed "
                         "real-length mode")
    ap.add_argument("--specforge-again", action="store_true",
                    help="run SpecForge at 4096 a second time after draftsmith's fixed runs, so that the ratio is "
                         "taken against both of the peer's runs (its step moved 9 %% between two device calls)")
    ap.add_argument("--synced-steps", type=int, default=0,
                    help="fixed 4096: also time this many Trainer steps waited for one by one (the timed figure is "
                         "the pipelined loop's, as draftsmith train runs)")
    ap.add_argument("--trace-steps", type=int, default=0,
                    help="fixed 4096 and the packed real-length mode: profile this many pipelined steps after the timed "
                         "ones (GPU busy and idle time, kernel time by kind)")
    ap.add_argument("--real-modes", default="packed,unpacked", help="real lengths: draftsmith's modes, in order")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    logs = args.out.parent / "specforge_compare_logs"
    logs.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    result: dict = {"what": __doc__.splitlines()[0], "command": " ".join(sys.argv), "date": str(datetime.date.today())}

    sf_grid: dict[int, dict] = {}
    if "specforge" not in skip:
        lines, secs = specforge_run(py, args, args.grid, logs / "specforge.log")
        result["specforge_env"] = next((r for r in lines if r.get("kind") == "env"), None)
        sf_grid = {r["seq"]: r for r in lines if r.get("impl") == "specforge" and r.get("status") == "ok"}
        result["specforge"] = {"wall_s": secs, "per_length": [r for r in lines if r.get("impl") == "specforge"]}
    if "fixed" not in skip:
        lines, secs = run([py, "benchmarks/gpu_train.py", "--trainer", "--compile", "--seq", "4096", "--steps",
                           str(args.steps + 3 + args.synced_steps), "--synced-steps", str(args.synced_steps),
                           "--trace-steps", str(args.trace_steps)], ROOT, 300, logs / "draftsmith_fixed.log")
        fixed = next((r for r in lines if r.get("mode") == "trainer"), None)
        result["draftsmith_fixed_4096"] = {"wall_s": secs, **(fixed or {"error": "no result; see the log"})}
        sf = sf_grid.get(4096)
        if fixed and sf:
            result["fixed_4096"] = fixed_ratio(fixed["tokens_per_s"], fixed["peak_gb_rank0"], sf)
        if args.cuda_graphs:  # one 4096-token document per packed row: the one shape CUDA graphs replay
            with tempfile.TemporaryDirectory() as tmp:
                one_bin, graphs_out = Path(tmp) / "fixed.json", Path(tmp) / "graphs.json"
                one_bin.write_text(json.dumps({"bins": [{"lo": 4096, "hi": 4096, "count": 1}]}))
                run([py, "benchmarks/bench_packing.py", "run", "--histogram", str(one_bin), "--device", "cuda",
                     "--compile", "--cuda-graphs", "--modes", "packed", "--samples", str(args.steps + 8),
                     "--steps", str(args.steps), "--out", str(graphs_out)], ROOT, 300,
                    logs / "draftsmith_fixed_graphs.log")
                graphs = json.loads(graphs_out.read_text())["packed"] if graphs_out.exists() else None
            result["draftsmith_fixed_4096_graphs"] = graphs or {"error": "no result; see the log"}
            if graphs and sf:
                result["fixed_4096_graphs"] = fixed_ratio(graphs["useful_tokens_per_s"], graphs["peak_gb"], sf)
    if args.specforge_again and "specforge" not in skip and "fixed" not in skip:
        lines, secs = specforge_run(py, args, "4096", logs / "specforge_again.log")
        again = next((r for r in lines if r.get("impl") == "specforge" and r.get("status") == "ok"), None)
        result["specforge_again_4096"] = {"wall_s": secs, **(again or {"error": "no result; see the log"})}
        fixed = result["draftsmith_fixed_4096"]
        if again and "tokens_per_s" in fixed:
            result["fixed_4096_again"] = fixed_ratio(fixed["tokens_per_s"], fixed["peak_gb_rank0"], again)
    if "real" not in skip:
        hist = load_histogram(args.histogram, args.scale_max)
        lengths = [min(n, 4096) for n in draw_lengths(hist, args.samples, 0)]
        with tempfile.TemporaryDirectory() as tmp:
            packing_out = Path(tmp) / "packing.json"
            scaled = Path(tmp) / "histogram.json"
            scaled.write_text(json.dumps(hist))
            run([py, "benchmarks/bench_packing.py", "run", "--histogram", str(scaled), "--device", "cuda", "--compile",
                 "--samples", str(args.samples), "--seed", "0", "--steps", str(args.steps), "--out", str(packing_out),
                 "--warm-shapes", "--modes", args.real_modes, "--trace-steps", str(args.trace_steps)]
                + (["--cuda-graphs"] if args.cuda_graphs else []),
                ROOT, args.real_limit_s, logs / "draftsmith_real.log")
            packing = json.loads(packing_out.read_text()) if packing_out.exists() else None
        real = {"histogram": str(args.histogram.relative_to(ROOT)), "scale_max": args.scale_max,
                "samples": args.samples, "mean_length": sum(lengths) / len(lengths)}
        if packing:
            for mode in ("packed", "unpacked"):
                if packing.get(mode):
                    packing[mode].pop("losses", None)
            real["draftsmith"] = packing
        if len(sf_grid) >= 2:
            grid_s = {n: r["step_ms"] / 1000 for n, r in sf_grid.items()}
            for name, floor in (("interpolated", False), ("floor", True)):
                seconds = sum(step_seconds(grid_s, n, floor) for n in lengths)
                real[f"specforge_{name}_tokens_per_s"] = sum(lengths) / seconds
        if packing and packing.get("packed") and "specforge_interpolated_tokens_per_s" in real:
            packed = packing["packed"]["useful_tokens_per_s"]
            real["ratios"] = {
                "packed_over_specforge": packed / real["specforge_interpolated_tokens_per_s"],
                "packed_over_specforge_floor": packed / real["specforge_floor_tokens_per_s"],
                "packed_over_unpacked": packing["packed_over_unpacked"], "goal_packed_over_specforge": 2.5}
        result["real_lengths"] = real
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result.get(k) for k in ("fixed_4096", "fixed_4096_graphs", "fixed_4096_again")}), flush=True)
    print(json.dumps(result.get("real_lengths", {}).get("ratios")), flush=True)


if __name__ == "__main__":
    main()
