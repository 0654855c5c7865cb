#!/usr/bin/env bash
# One device call (nvidia-h200), docs/gpu.md "2026-11-30": the CUDA kernel tests, TTT attention (summary
# key vs log-sum-exp merge), the compiled offline step at 4096 / 8192 with a profile, the real Trainer.
set -u
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
PYTHONPATH=src timeout 120 python3 -m pytest tests/test_gpu.py -q -p no:cacheprovider > "$OUT/test_gpu.log" 2>&1
timeout 100 python3 benchmarks/gpu_attention.py --out "$OUT/gpu_attention.json" > "$OUT/attention.log" 2>&1
timeout 240 python3 benchmarks/gpu_train.py --seq 4096,8192 --compile --profile --out "$OUT/gpu_train_compiled.json" \
  > "$OUT/train.log" 2>&1
timeout 120 python3 benchmarks/gpu_train.py --trainer --compile --seq 4096 --steps 12 > "$OUT/trainer.log" 2>&1
tail -n 3 "$OUT"/*.log
