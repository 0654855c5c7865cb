#!/usr/bin/env bash
# Second device call of docs/gpu.md (nvidia-h200-x2): FSDP2 with fused AdamW (loss parity), a profiled step,
# online training, capture on a Qwen3-30B-A3B-shaped MoE.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # device rule: multicast off
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
B=benchmarks/gpu_train.py
run() { echo "== $*"; timeout "${T:-150}" "$@" 2>&1 | grep -v -i warn | tail -40; }
run python3 -m torch.distributed.run --standalone --nproc-per-node 2 $B --trainer --seq 4096 --parallel fsdp | tee -a "$OUT/trainer.jsonl"
CUDA_VISIBLE_DEVICES=0 run python3 $B --seq 4096 --profile --out "$OUT/profile.json" > "$OUT/profile.txt"
CUDA_VISIBLE_DEVICES=0 run python3 $B --seq none --online --out "$OUT/online.json"
CUDA_VISIBLE_DEVICES=0 T=200 run python3 $B --seq none --capture-moe --out "$OUT/capture_moe.json"
