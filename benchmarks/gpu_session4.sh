#!/usr/bin/env bash
# One device call (nvidia-h200), docs/gpu.md "2026-11-30": TTT attention variants, the compiled offline
# step at 4096 / 8192 with a profile, then the real Trainer (--compile) at 4096.
set -u
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
timeout 150 python3 benchmarks/gpu_attention.py --out "$OUT/gpu_attention.json" > "$OUT/attention.log" 2>&1
timeout 290 python3 benchmarks/gpu_train.py --seq 4096,8192 --compile --profile --out "$OUT/gpu_train_compiled.json" \
  > "$OUT/train.log" 2>&1
timeout 140 python3 benchmarks/gpu_train.py --trainer --compile --seq 4096 --steps 12 > "$OUT/trainer.log" 2>&1
tail -3 "$OUT"/*.log
