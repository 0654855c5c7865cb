#!/usr/bin/env bash
# The GPU measurements of docs/gpu.md in one device call (nvidia-h200-x2): single-GPU TTT step (eager and
# compiled), the real Trainer on 1 and 2 GPUs (DDP, FSDP2), one profiled step. Results: JSON lines in $OUT.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # device rule: multicast off
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
B=benchmarks/gpu_train.py
TR="-m torch.distributed.run --standalone"
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpus.txt"
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)" | tee -a "$OUT/gpus.txt"
run() { echo "== $*"; timeout "${T:-200}" "$@" 2>&1 | grep -v Warning | tail -25; }
CUDA_VISIBLE_DEVICES=0 run python3 $B --seq 4096,8192 --out "$OUT/step_eager.json"
CUDA_VISIBLE_DEVICES=0 run python3 $B --seq 4096,8192 --compile --out "$OUT/step_compiled.json"
for c in "" "--compile"; do
  CUDA_VISIBLE_DEVICES=0 run python3 $TR --nproc-per-node 1 $B --trainer --seq 4096 --grad-accum 1 $c | tee -a "$OUT/trainer.jsonl"
  CUDA_VISIBLE_DEVICES=0 run python3 $TR --nproc-per-node 1 $B --trainer --seq 4096 --grad-accum 2 $c | tee -a "$OUT/trainer.jsonl"
  for p in ddp fsdp; do
    run python3 $TR --nproc-per-node 2 $B --trainer --seq 4096 --grad-accum 1 --parallel $p $c | tee -a "$OUT/trainer.jsonl"
  done
done
CUDA_VISIBLE_DEVICES=0 T=120 run python3 $B --seq 4096 --profile --out "$OUT/profile.json" > "$OUT/profile.txt"
grep -h '^{' "$OUT"/trainer.jsonl | python3 -c "
import json,sys
for l in sys.stdin:
    r=json.loads(l); print(r['parallel'], r['world'], 'ga', r['grad_accum'], 'c' if r['compiled'] else 'e', round(r['tokens_per_s']), round(r['peak_gb_rank0'],1), r['losses'][:4])"
