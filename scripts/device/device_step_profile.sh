#!/usr/bin/env bash
# Developer tool for the lent GPU machine (docs/gpu.md, "CUDA graphs over the compiled step"): one device call that
# checks the compiled training forward on CUDA (tests/test_gpu.py) and profiles the step at the embedded target's
# shapes (SmolLM2-135M drafter, normed recipe, TTT 7), each setting in a fresh process, so that no
# setting inherits another's compiled graphs or dynamo's dynamic-shape recompiles:
#
#   graphs-4k   --compile --cuda-graphs, 4096-token rows (the headline: 28.7 ms waited, 19 ms looped;
#               one H200, 2026-12-03)
#   eager-4k    eager, 4096-token rows (the reference: 52.6 ms)
#   graphs-8k   --compile --cuda-graphs, 8192-token rows (32.2 ms)
#   before-4k   only with BEFORE=DIR (a checkout of the commit to compare with, e.g. a git worktree): graphs-4k
#               profiled with DIR's own code and benchmark, last, if the call has time left
#
#   bash scripts/device/device_step_profile.sh          # in the repository root; carry .whl where pydantic is missing
#
# Every command runs under `timeout`, sized from what is left of BUDGET_S (default 480 s, under the call's 600 s),
# and everything printed is tee'd to $OUT/device_step_profile.log, so that a call cut short still returns what
# finished: $OUT/<step>.txt (each command's output), $OUT/profile_<setting>.json (written by the benchmark once
# its setting is measured).
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/device_step_profile}
mkdir -p "$OUT"
BUDGET_S=${BUDGET_S:-480}
export PYTHONPATH=${PYTHONPATH:-/tmp/site:$PWD/src}
# Where a run falls back from the plan: a graph break, a recompile, a CUDA graph skipped (and why).
export TORCH_LOGS=${TORCH_LOGS:-graph_breaks,recompiles,perf_hints}
PROFILE=(--device cuda --host --warmup 6 --steps 16 --profile-steps 2)
NORMED=recipe=normed
GRAPHS=recipe=normed,compile=true,cuda_graphs=true
source scripts/device/device_steps.sh  # t0, left, step, python_ready

main() {
    python_ready || return
    step test_gpu 170 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py
    step graphs-4k 120 python3 benchmarks/train_step_profile.py "${PROFILE[@]}" --setting "graphs-4k:$GRAPHS" \
        --out "$OUT/profile_graphs-4k.json"
    step eager-4k 60 python3 benchmarks/train_step_profile.py "${PROFILE[@]}" --setting "eager-4k:$NORMED" \
        --out "$OUT/profile_eager-4k.json"
    step graphs-8k 120 python3 benchmarks/train_step_profile.py "${PROFILE[@]}" \
        --setting "graphs-8k:$GRAPHS,batch_tokens=8192" --out "$OUT/profile_graphs-8k.json"
    if [ -n "${BEFORE:-}" ]; then
        step before-4k 120 env PYTHONPATH="/tmp/site:$BEFORE/src" python3 "$BEFORE/benchmarks/train_step_profile.py" \
            "${PROFILE[@]}" --setting "before-4k:$GRAPHS" --out "$OUT/profile_before-4k.json"
    fi
    echo "=== done after $(( $(date +%s) - t0 )) s"
    ls -la "$OUT"
}

main 2>&1 | tee -a "$OUT/device_step_profile.log"
