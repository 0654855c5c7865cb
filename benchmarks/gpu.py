"""The GPU measurements of docs/gpu-results.md as named suites: one device call runs one or more suites.

Each suite is a list of commands (benchmarks/gpu_train.py, benchmarks/gpu_attention.py, tests/test_gpu.py)
run one after the other with a timeout each; their JSON lines and JSON outputs are gathered into one results
file per suite, `<out>/gpu_<suite>.json` (history is git's, not the file name's). Multicast stays off
(the device rule: NCCL_NVLS_ENABLE=0 and friends) for every command.

Multi-stage device runs that build something (a drafter, the speculators comparison of docs/peers.md) are
developer tools under scripts/ (build_embedded_drafter.sh, device/gpu_speculators_compare.sh), not suites.

Run (on the GPU machine):
    python3 benchmarks/gpu.py --suite kernels,step            # nvidia-h200
    python3 benchmarks/gpu.py --suite trainer --out $OUT      # nvidia-h200-x2: 1 GPU, DDP and FSDP2 on 2
    python3 benchmarks/gpu.py --list
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRAIN = "benchmarks/gpu_train.py"
TORCHRUN = ("-m", "torch.distributed.run", "--standalone")
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@dataclass(frozen=True)
class Command:
    """One measured command: python arguments, its timeout, and the GPUs it may see (None: all)."""

    args: tuple[str, ...]
    timeout_s: int
    gpus: str | None = "0"
    writes_json: bool = False
    """The command takes `--out FILE` and writes its result there (else its JSON lines on stdout count)."""


def trainer(world: int, *flags: str, timeout_s: int = 120) -> Command:
    """The real Trainer under torchrun on `world` GPUs (benchmarks/gpu_train.py --trainer)."""
    return Command((*TORCHRUN, "--nproc-per-node", str(world), TRAIN, "--trainer", *flags), timeout_s,
                   gpus="0" if world == 1 else None)


@dataclass(frozen=True)
class Suite:
    doc: str
    commands: tuple[Command, ...] = field(default_factory=tuple)


SUITES = {
    "kernels": Suite("CUDA kernel tests (tests/test_gpu.py) and TTT attention: summary key vs LSE merge", (
        Command(("-m", "pytest", "tests/test_gpu.py", "-q", "-p", "no:cacheprovider"), 120),
        Command(("benchmarks/gpu_attention.py",), 100, writes_json=True),
    )),
    "step": Suite("the offline TTT step at 8B shapes, eager and compiled, 4096 / 8192, one profiled step", (
        Command((TRAIN, "--seq", "4096,8192"), 200, writes_json=True),
        Command((TRAIN, "--seq", "4096,8192", "--compile", "--profile"), 240, writes_json=True),
    )),
    "trainer": Suite("the real Trainer (compiled) on one GPU (grad-accum 2) and two (DDP; the same global "
                     "batch), FSDP2 eager on two (nvidia-h200-x2)", (
        trainer(1, "--compile", "--seq", "4096", "--grad-accum", "2", "--steps", "10"),
        trainer(2, "--compile", "--seq", "4096", "--steps", "10", "--parallel", "ddp"),
        trainer(2, "--seq", "4096", "--steps", "10", "--parallel", "fsdp"),
        trainer(1, "--seq", "4096", "--grad-accum", "2", "--steps", "10"),
    )),
    "parity": Suite("FSDP2 and DDP loss parity against one GPU with the same global batch, fp32 and bf16 "
                    "autocast, seq 2048 (nvidia-h200-x2)", tuple(
        cmd for prec in (("--fp32",), ()) for cmd in (
            trainer(1, "--seq", "2048", "--grad-accum", "2", "--steps", "8", *prec, timeout_s=150),
            trainer(2, "--seq", "2048", "--steps", "8", "--parallel", "fsdp", *prec, timeout_s=150),
            trainer(2, "--seq", "2048", "--steps", "8", "--parallel", "ddp", *prec, timeout_s=150)))),
    "online": Suite("online training: an 8B-shaped target and the drafter in one process", (
        Command((TRAIN, "--seq", "none", "--online"), 150, writes_json=True),
    )),
    "capture-moe": Suite("capture vs forward on a Qwen3-30B-A3B-shaped MoE", (
        Command((TRAIN, "--seq", "none", "--capture-moe"), 200, writes_json=True),
    )),
}


def json_lines(text: str) -> list[dict]:
    rows = []
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def run_command(cmd: Command, scratch: Path) -> dict:
    """One command: its exit status, seconds, output tail, and the results it wrote or printed."""
    env = {**os.environ, **NO_MULTICAST, "PYTHONPATH": str(ROOT / "src")}
    if cmd.gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = cmd.gpus
    out = scratch / f"result_{time.monotonic_ns()}.json"
    argv = [sys.executable, *cmd.args, *(("--out", str(out)) if cmd.writes_json else ())]
    print("== " + " ".join(cmd.args), flush=True)
    t = time.perf_counter()
    try:
        p = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=cmd.timeout_s)
        rc, text = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as exc:  # what it printed before the timeout still counts
        partial = exc.stdout or ""
        rc, text = "timeout", partial.decode(errors="replace") if isinstance(partial, bytes) else partial
    tail = "\n".join(line for line in text.splitlines() if "warn" not in line.lower())[-4000:]
    print(tail[-1500:], flush=True)
    record = {"command": " ".join(cmd.args), "rc": rc, "seconds": round(time.perf_counter() - t, 1),
              "lines": json_lines(text), "tail": tail}
    if out.exists():
        record["result"] = json.loads(out.read_text())
    return record


def device_info() -> dict:
    import torch

    return {"torch": torch.__version__, "cuda": torch.version.cuda,
            "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}


def run_suite(name: str, out_dir: Path) -> Path:
    suite = SUITES[name]
    with tempfile.TemporaryDirectory() as scratch:
        runs = [run_command(cmd, Path(scratch)) for cmd in suite.commands]
    path = out_dir / f"gpu_{name}.json"
    path.write_text(json.dumps({"suite": name, "doc": suite.doc, "device": device_info(), "runs": runs},
                               indent=2) + "\n")
    print(f"gpu: {name} -> {path}")
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", default="", help=f"comma list of: {', '.join(SUITES)}")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results", help="directory of the results")
    ap.add_argument("--list", action="store_true", help="print the suites and their commands")
    args = ap.parse_args()
    if args.list or not args.suite:
        for name, suite in SUITES.items():
            print(f"{name}: {suite.doc}")
            for cmd in suite.commands:
                print(f"    {' '.join(cmd.args)}  (timeout {cmd.timeout_s} s)")
        return 0
    names = [s.strip() for s in args.suite.split(",") if s.strip()]
    unknown = [n for n in names if n not in SUITES]
    if unknown:
        ap.error(f"unknown suite {', '.join(unknown)}; the suites are {', '.join(SUITES)}")
    args.out.mkdir(parents=True, exist_ok=True)
    for name in names:
        run_suite(name, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
