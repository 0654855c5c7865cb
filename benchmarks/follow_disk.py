"""Bytes on disk in flight while `train --follow --delete-consumed` consumes a store that a capture is writing.

Captures SmolLM2 in process (transformers, fp32, CPU) into a store while `draftsmith train --follow
--delete-consumed` runs beside it as a second process, samples the store's shard bytes every 10 ms, and
reports the peak against the total the capture wrote. Writes benchmarks/results/follow_disk.json.

    OMP_NUM_THREADS=1 nice -n 10 .venv/bin/python benchmarks/follow_disk.py --conversations 48
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from engine_capture import FolderPeak, write_conversations  # benchmarks/engine_capture.py

from draftsmith.capture.local import CaptureSettings, capture
from draftsmith.capture.store import FeatureStore


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=48)
    ap.add_argument("--shard-tokens", type=int, default=400)
    ap.add_argument("--capture-batch-tokens", type=int, default=256)
    ap.add_argument("--save-every", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/follow_disk.json"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        conv, store, run = write_conversations(root / "conv.jsonl", args.conversations), root / "store", root / "run"
        train_cmd = [sys.executable, "-m", "draftsmith.cli", "train", "--store", str(store), "--out", str(run),
                     "--follow", "--delete-consumed", "--max-steps", "100000", "--save-every", str(args.save_every),
                     "--batch-tokens", "256", "--ttt-steps", "3", "--eval-fraction", "0.1", "--eval-every", "100000",
                     "--lr", "1e-3", "--quiet", "--follow-timeout-s", "600"]
        shards = FolderPeak(store, "shard-*.safetensors")
        whole = FolderPeak(store, "*")
        store.mkdir()
        shards.start()
        whole.start()
        t0 = time.monotonic()
        trainer = subprocess.Popen(train_cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        summary = capture(conv, store, CaptureSettings(batch_tokens=args.capture_batch_tokens), target="smollm2",
                          shard_tokens=args.shard_tokens)
        capture_s = time.monotonic() - t0
        out, err = trainer.communicate(timeout=1800)
        train_s = time.monotonic() - t0
        shards.stop.set()
        whole.stop.set()
        if trainer.returncode != 0:
            raise SystemExit(f"train failed:\n{err[-3000:]}")
        manifest = FeatureStore(store).manifest
        written = sum((store / s["file"]).stat().st_size if (store / s["file"]).exists() else 0
                      for s in manifest["shards"])
        assert written == 0, "every shard was consumed and deleted"
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        steps = max(r["step"] for r in records if "loss" in r and "eval" not in r)
        total = sum(shards.seen.values())  # each shard's size, seen while it was on disk
        consumed = sum(p.stat().st_size for p in (run / "consumed").glob("*"))
        at_capture_end = max((b for t, b in shards.samples if t <= capture_s), default=0)
        result = {
            "command": "nice -n 10 .venv/bin/python benchmarks/follow_disk.py " + " ".join(sys.argv[1:]),
            "settings": {"target": "SmolLM2-135M-Instruct (embedded), in-process capture fp32 on CPU",
                         "conversations": args.conversations, "shard_tokens": args.shard_tokens,
                         "capture_batch_tokens": args.capture_batch_tokens, "train": " ".join(train_cmd[3:])},
            "shards": len(manifest["shards"]), "samples": manifest["num_samples"], "tokens": manifest["num_tokens"],
            "shard_bytes_written": total,
            "shard_files_seen_by_the_sampler": len(shards.seen),
            "peak_shard_bytes_on_disk": shards.peak,
            "peak_store_dir_bytes": whole.peak,
            "peak_share_of_written": round(shards.peak / total, 3),
            "shard_bytes_on_disk_when_capture_finished": at_capture_end,
            "shard_bytes_on_disk_at_end": written,
            "consumed_dir_bytes (held-back copies + plans)": consumed,
            "capture_s": round(capture_s, 1), "capture_tok_per_s": round(summary.tokens / max(summary.seconds, 1e-9)),
            "train_wall_s": round(train_s, 1), "train_steps": steps,
        }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
