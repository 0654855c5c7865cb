"""How the draft head starts, measured: the target's head rows (trained or frozen) against a random head.

One difference between speculators' and draftsmith's trainers that no setting names (docs/peers.md) is the
head: speculators 0.9.0 copies the target's lm_head rows of the draft vocabulary into the drafter and freezes
them (`speculators/model.py`, `_load_verifier_weights`); draftsmith started from nn.Linear's random init. This benchmark trains the same drafter on the same store with
each `--head-init` / `--train-head` choice, same seed and data order, and records the held-back accuracy and
simulated tau (engine walk) at every eval.

Data, with no download: a store captured by the embedded target (SmolLM2-135M-Instruct, CPU) from
conversations whose answers are local text: Python's own documentation topics (`pydoc_data.topics`, English
prose) and standard-library modules (code). Not the target's own answers, so absolute tau is low; the runs are
compared with each other only.

    .venv/bin/python benchmarks/experiments/head_init_ablation.py --work /tmp/headinit --out benchmarks/results/head_init_ablation.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

VARIANTS = {  # name: train flags
    "random-trained": ["--recipe", "plain", "--head-init", "random"],
    "target-trained": ["--recipe", "plain", "--head-init", "target"],
    "target-frozen": ["--recipe", "plain", "--head-init", "target", "--no-train-head"],
}


def local_text_conversations(path: Path, chars: int, chunk: int = 1600) -> int:
    """Write conversations whose answers are local text (prose and code) until `chars` characters; their count."""
    import pydoc_data.topics as topics

    prose = [topics.topics[k] for k in sorted(topics.topics)]
    lib = Path(sysconfig.get_paths()["stdlib"])
    code = [p.read_text(errors="replace") for p in sorted(lib.glob("*.py"))]
    pieces: list[tuple[str, str]] = []
    for kind, texts in (("prose", prose), ("code", code)):
        for text in texts:
            for start in range(0, len(text) - chunk // 4, chunk):
                pieces.append((kind, text[start:start + chunk]))
    # interleave prose and code so any prefix holds both
    prose_p = [p for p in pieces if p[0] == "prose"]
    code_p = [p for p in pieces if p[0] == "code"]
    mixed = [p for pair in zip(prose_p, code_p) for p in pair] + prose_p[len(code_p):] + code_p[len(prose_p):]
    n = total = 0
    with path.open("w") as f:
        for kind, text in mixed:
            if total >= chars:
                break
            ask = ("Explain this part of the Python documentation." if kind == "prose"
                   else "Show me a part of a Python standard-library module.")
            f.write(json.dumps({"id": f"local-{n}", "messages": [{"role": "user", "content": ask},
                                                                 {"role": "assistant", "content": text}]}) + "\n")
            n += 1
            total += len(text)
    return n


def evals(metrics: Path) -> list[dict]:
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    return [{"step": r["step"], "loss": r["eval"]["loss"], "acc": r["eval"]["acc"],
             "tau": r["eval"]["tau"]} for r in rows if "eval" in r]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", default="/tmp/headinit")
    p.add_argument("--out", default="benchmarks/results/head_init_ablation.json")
    p.add_argument("--chars", type=int, default=2_000_000, help="characters of local text to capture")
    p.add_argument("--conversations", help="use this conversations file (default: local text, --chars of it)")
    p.add_argument("--capture-args", default="--device cpu", help="extra `draftsmith capture` flags")
    p.add_argument("--concurrent", action="store_true",
                   help="train the variants at once (one GPU is launch-bound on a drafter this small)")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--lr", default="1e-4", help="comma-separated: every variant at each")
    p.add_argument("--train-args", default="--epochs 1 --ttt-steps 7 --batch-tokens 4096 --eval-every 50 "
                                           "--save-every 100000 --log-every 50 --device cpu")
    args = p.parse_args(argv)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    ds = [sys.executable, "-m", "draftsmith"]
    conv, store = Path(args.conversations or work / "conversations.jsonl"), work / "store"
    if not conv.is_file():
        print(f"conversations: {local_text_conversations(conv, args.chars)}", flush=True)
    t0 = time.monotonic()
    subprocess.run([*ds, "capture", "--target", "smollm2", "--conversations", str(conv), "--out", str(store),
                    "--max-length", "1024", *args.capture_args.split()], check=True)
    manifest = json.loads((store / "manifest.json").read_text())
    result = {"what": "draft head initialisation: the target's rows (trained / frozen) against random, same store, "
                      "seed and data order", "command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
              "store_tokens": manifest["num_tokens"], "capture_s": time.monotonic() - t0,
              "train_args": args.train_args, "runs": []}
    runs = [(name, lr) for lr in args.lr.split(",") for name in args.variants.split(",")]
    started: dict[tuple[str, str], tuple[subprocess.Popen, float]] = {}
    for name, lr in runs:
        out = work / f"{name}-lr{lr}"
        cmd = [*ds, "train", "--store", str(store), "--out", str(out), "--lr", lr, "--quiet",
               *args.train_args.split(), *VARIANTS[name]]
        log = (work / f"{name}-lr{lr}.log").open("w")
        started[(name, lr)] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), time.monotonic())
        if not args.concurrent:
            started[(name, lr)][0].wait()
    for (name, lr), (proc, t) in started.items():
        if proc.wait() != 0:
            sys.exit(f"{name} at lr {lr} failed: see {work / f'{name}-lr{lr}.log'}")
        ev = evals(work / f"{name}-lr{lr}" / "metrics.jsonl")
        result["runs"].append({"variant": name, "lr": float(lr), "seconds": time.monotonic() - t, "evals": ev})
        last = ev[-1]
        print(f"{name:15s} lr {lr}: step {last['step']} loss {last['loss']:.3f} acc0 {last['acc'][0]:.3f} "
              f"tau4 {last['tau']['4']:.3f}", flush=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
