#!/usr/bin/env bash
# Developer tool (the second half of scripts/gpu_smollm2.sh): bring its drafter back within the device's limits.
#
# Wait (at most WAIT seconds) for scripts/gpu_smollm2.sh, running detached on the device, then put its
# results under $OUT within the device's return limits (8 files, 16 MiB each): the drafter checkpoint in
# 15 MB parts (`cat model.safetensors.part* > model.safetensors` to rejoin), the run's small files in one
# tarball, the conversations gzipped. Usage: W=/tmp/smol LOG=/tmp/smol.log WAIT=540 bash scripts/gpu_smollm2_collect.sh
set -u
W=${W:-/tmp/smol}; LOG=${LOG:-/tmp/smol.log}; WAIT=${WAIT:-540}; OUT=${OUT:-/tmp/smol_out}
deadline=$((SECONDS + WAIT))
while [ ! -f "$W/done" ] && [ $SECONDS -lt $deadline ]; do sleep 5; done
grep -v "it/s\]" "$LOG" | tail -c 8000
[ -f "$W/done" ] || { echo "still running"; exit 3; }
[ -f "$W/train.rc" ] || { echo "the run failed before training ended (exit $(cat "$W/done"))"; exit 4; }
src="$W/train/drafter"
if [ ! -f "$src/model.safetensors" ]; then  # stopped by its timeout: take the newest checkpoint
    src="$W/train/checkpoints/$(cat "$W/train/checkpoints/latest")"
fi
echo "drafter from $src"
mkdir -p "$OUT"
split -b 15000000 -d "$src/model.safetensors" "$OUT/model.safetensors.part"
sha256sum "$src/model.safetensors" | tee "$W/model.sha256"
cp "$src/config.json" "$W/drafter_config.json"
cp "$LOG" "$W/run.log"
tar czf "$OUT/meta.tgz" -C "$W" drafter_config.json model.sha256 run.log train.rc \
    train/metrics.jsonl train/train_config.json
gzip -c "$W/conversations.jsonl" > "$OUT/conversations.jsonl.gz"
ls -la "$OUT"
