#!/usr/bin/env bash
# Third device call of docs/gpu.md (nvidia-h200-x2): FSDP2 loss parity in fp32 (no autocast) and in bf16
# autocast, against one GPU with the same global batch; seq 2048 to keep fp32 steps short.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # device rule: multicast off
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
B=benchmarks/gpu_train.py
TR="python3 -m torch.distributed.run --standalone"
run() { echo "== $*"; timeout 150 "$@" 2>&1 | grep '^{' | tee -a "$OUT/parity.jsonl"; }
for prec in --fp32 ""; do
  CUDA_VISIBLE_DEVICES=0 run $TR --nproc-per-node 1 $B --trainer --seq 2048 --grad-accum 2 --steps 8 $prec
  run $TR --nproc-per-node 2 $B --trainer --seq 2048 --steps 8 --parallel fsdp $prec
  run $TR --nproc-per-node 2 $B --trainer --seq 2048 --steps 8 --parallel ddp $prec
done
