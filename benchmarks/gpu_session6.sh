#!/usr/bin/env bash
# One device call (nvidia-h200-x2), docs/gpu.md "2026-11-30": CUDA kernel tests, TTT attention variants,
# the compiled offline step at 4096 / 8192 with a profile, then the real Trainer (--compile) on one GPU
# (grad-accum 2) and on two (DDP, grad-accum 1: the same global batch), and FSDP2 (eager) on two.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # device rule: multicast off
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export CUDA_VISIBLE_DEVICES=0
PYTHONPATH=src timeout 90 python3 -m pytest tests/test_gpu.py -q -p no:cacheprovider > "$OUT/test_gpu.log" 2>&1
timeout 80 python3 benchmarks/gpu_attention.py --out "$OUT/gpu_attention.json" > "$OUT/attention.log" 2>&1
timeout 200 python3 benchmarks/gpu_train.py --seq 4096,8192 --compile --profile --out "$OUT/gpu_train_compiled.json" \
  > "$OUT/train.log" 2>&1
B=benchmarks/gpu_train.py
TR="python3 -m torch.distributed.run --standalone"
run() { echo "== $*" >> "$OUT/trainer.log"; timeout "$1" "${@:2}" >> "$OUT/trainer.log" 2>&1; }
run 100 $TR --nproc-per-node 1 $B --trainer --compile --seq 4096 --grad-accum 2 --steps 10
unset CUDA_VISIBLE_DEVICES
run 110 $TR --nproc-per-node 2 $B --trainer --compile --seq 4096 --steps 10 --parallel ddp
run 80 $TR --nproc-per-node 2 $B --trainer --seq 4096 --steps 10 --parallel fsdp
CUDA_VISIBLE_DEVICES=0 run 60 $TR --nproc-per-node 1 $B --trainer --seq 4096 --grad-accum 2 --steps 10
grep -h '^{' "$OUT"/*.log | cut -c1-400
