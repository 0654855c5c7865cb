#!/usr/bin/env bash
# Developer tool for the lent GPU machine (docs/gpu.md, "Beside SpecForge"): the training-throughput
# measurements still owed, one device call each, at the Llama-3.1-8B drafter's shapes (TTT 7, bf16), every
# setting in a fresh process. MODE picks the call:
#
#   MODE=real  (355 s on one H100) real lengths in one call: SpecForge's batch-1 grid (512-4096), then draftsmith
#              packed, then unpacked (one step of each micro-batch shape compiled before the timed steps): packed over
#              SpecForge and over unpacked (2026-12-07, one H100: 2.13x and 1.00x).
#   MODE=before with BEFORE=DIR (a checkout of the commit to compare with, e.g. `git worktree add /tmp/before
#              edb2da0` for the TTT diagonal as fused products, 7777b93; 114 s): DIR's gpu_train.py, then this
#              tree's, same arguments.
#
#   bash scripts/device/device_throughput_ab.sh      # in the repository root on the GPU machine
#
# Carry `anchors` (SpecForge under anchors/specforge, as ../shared/anchors/specforge-bench/RUN.md sets it up) for
# MODE=real, and `.whl` where the machine lacks pydantic (`bash scripts/device/device_carry.sh prepare`
# downloads it). For MODE=before, only this checkout travels: copy the other commit's src and benchmarks into an
# ignored folder here (`.before` in the 2026-12-07 A/B of docs/gpu-results.md, its drafter weights left out) and
# carry that.
# Every command runs under `timeout`, sized from what is left of BUDGET_S (default 570 s, under the call's 600 s);
# all output is tee'd to $OUT/device_throughput_ab.log and each command's to $OUT/<name>.txt, so a call cut short
# still returns what finished.
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/device_throughput_ab}
mkdir -p "$OUT"
MODE=${MODE:-real}
BUDGET_S=${BUDGET_S:-570}
export PYTHONPATH=${PYTHONPATH:-/tmp/site:$PWD/src}
source scripts/device/device_steps.sh  # t0, left, step, python_ready
TRAINER=(--trainer --compile --seq 4096 --steps 11 --synced-steps 0 --trace-steps 2)

need_anchors() {
    [ -d anchors/specforge ] || { echo "FATAL: anchors/specforge is missing (carry anchors)"; return 4; }
}

main() {
    python_ready || return
    case "$MODE" in
        real)
            need_anchors || return
            step real 585 python3 benchmarks/specforge_compare.py --grid 512,1024,2048,3072,4096 --skip fixed \
                --specforge-budget-s 120 --real-modes packed,unpacked --real-limit-s 400 --steps 8 \
                --out "$OUT/sf_real.json" ;;
        before)
            [ -d "${BEFORE:-}" ] || { echo "FATAL: BEFORE=DIR (a checkout to compare with) is not a directory"; return 4; }
            step before 270 env PYTHONPATH="/tmp/site:$BEFORE/src" python3 "$BEFORE/benchmarks/gpu_train.py" \
                "${TRAINER[@]}" --out "$OUT/gpu_train_before.json"
            step head 270 python3 benchmarks/gpu_train.py "${TRAINER[@]}" --out "$OUT/gpu_train_head.json" ;;
        *) echo "FATAL: MODE is real or before (got '$MODE')"; return 2 ;;
    esac
}

main 2>&1 | tee "$OUT/device_throughput_ab.log"
