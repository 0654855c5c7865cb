#!/usr/bin/env bash
# Developer tool for the lent GPU machine (docs/gpu.md): call 3 (and every later call) of a device session that
# rebuilds the embedded drafter. It joins the GGUF carried in two parts, starts scripts/build_embedded_drafter.sh
# once under setsid, and polls; later calls, carrying only this script, poll the same job to its end.
#
#   call 1: carry [".whl", ".carry/gguf.xz.part00", ".carry/gguf.sha256"] (bash scripts/device/device_carry.sh prepare):
#           python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && cp .carry/gguf.xz.part00 /tmp/
#   call 2: carry [".carry/gguf.xz.part01"]: cp .carry/gguf.xz.part01 /tmp/
#   call 3: bash scripts/device/device_carry.sh restore here, then at once carry [".carry/gguf.sha256"]:
#           BUILD='WAVES="96:0 97:0" SELF_COUNT=30000 ROWS=2048 INIT_FROM=smollm2 EPOCHS=2 LR=3e-4 DRAFT_VOCAB=12288 TRAIN_ARGS="--compile --cuda-graphs" TRAIN_TIMEOUT=600' POLL=560 bash scripts/device/device_build_call.sh
#           (drafters 7 and 8 of docs/eval.md used seeds 92/93 and 94/95; their call-3 wrappers set ROWS from
#           nvidia-smi --query-gpu=memory.total; drafter 8's also passed STAGES_2=pack, no eval on the device, and
#           TRAIN_TIMEOUT=720)
#           (ROWS=2048 holds about 95 GiB during regeneration: an H200 only; the device tool may lend an H100, 80 GB,
#           so check nvidia-smi in call 1 and pass ROWS=1024 there. Drafter 7's H100 build at ROWS=1024: data 521 s
#           (about 79,000 answer tok/s), training 449 s, export and the chat-eval sweep 116 s.)
#   call 4+: POLL=560 bash scripts/device/device_build_call.sh   (returns the pack under $OUT once the job is done)
#
# Safe against the ways a build has lost its job
# (docs/gpu.md, "Running the SmolLM2 target on a machine without network"): the GGUF is joined under a temporary
# name and moved into place only when its sha256 matches; a running job is recognised by its pid, not by an input
# file; a call on a fresh machine (the last one went back while this side was away) fails at once instead of
# polling nothing.
# BUILD: the build's knobs as shell assignments (build_embedded_drafter.sh lists them); STAGES_1 / STAGES_2: the
# two build passes (default 'setup data train export pack', then 'eval pack', so the weights come back first).
# AFTER (given with BUILD): more work for the same job once the build is done, run from the build's copy of the tree
# with the build's files in /tmp/ds (e.g. scripts/device/gpu_speculators_compare.sh on a slice of its conversations);
# its output goes to /tmp/after.log and it writes what it returns under /tmp/after. The build's end is marked by
# /tmp/build.done, the job's by /tmp/job.done. UNTIL (build, the default, or job): what a call waits for;
# RETURN (pack, the default, or after): which folder comes back under $OUT, with the log of that part.
set -u
t0=$(date +%s)
nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader
state=none
if [ -f /tmp/job.done ]; then state=done
elif [ -f /tmp/job.pid ] && kill -0 "$(cat /tmp/job.pid)" 2>/dev/null; then state=running
elif [ -f /tmp/job.pid ]; then state=died; fi
echo "job: $state"
if [ "$state" = died ]; then echo "the job's process is gone without job.done; its log ends:"; tail -c 3000 /tmp/job.log; exit 6; fi
if [ "$state" = none ]; then
  [ -n "${BUILD:-}" ] || { echo "FATAL: no job on this machine and no BUILD given (a fresh machine: start again from call 1)"; exit 4; }
  part1=.carry/gguf.xz.part01; [ -f "$part1" ] || part1=/tmp/gguf.xz.part01  # call 2 may have left it there
  [ -f /tmp/gguf.xz.part00 ] && [ -f "$part1" ] || { echo "FATAL: a GGUF part is missing (part00 comes from call 1 on this machine, part01 from call 2 or this one)"; exit 4; }
  cat /tmp/gguf.xz.part00 "$part1" | xz -d -T8 > /tmp/smollm2.gguf.tmp || { echo "FATAL: xz failed"; exit 3; }
  echo "$(cat .carry/gguf.sha256)  /tmp/smollm2.gguf.tmp" | sha256sum -c - || { echo "FATAL: the joined GGUF's sha256 differs"; exit 3; }
  mv /tmp/smollm2.gguf.tmp /tmp/smollm2.gguf
  rm -rf /tmp/repo /tmp/pack /tmp/ds /tmp/after /tmp/build.done && mkdir -p /tmp/repo && cp -r src scripts configs benchmarks /tmp/repo/
  cat > /tmp/job.sh <<JOB
cd /tmp/repo
export PYTHONPATH=/tmp/site W=/tmp/ds GGUF=/tmp/smollm2.gguf PACK=/tmp/pack
export $BUILD
STAGES='${STAGES_1:-setup data train export pack}' bash scripts/build_embedded_drafter.sh
STAGES='${STAGES_2:-eval pack}' bash scripts/build_embedded_drafter.sh
touch /tmp/build.done
mkdir -p /tmp/after
( ${AFTER:-true} ) > /tmp/after.log 2>&1
touch /tmp/job.done
JOB
  setsid nohup bash /tmp/job.sh > /tmp/job.log 2>&1 < /dev/null &
  echo $! > /tmp/job.pid
  echo "started the build, pid $(cat /tmp/job.pid)"
  sleep 5
fi
[ -f /tmp/job.log ] || { echo "FATAL: no /tmp/job.log on this machine"; exit 5; }
until_file=/tmp/${UNTIL:-build}.done
while [ $(( $(date +%s) - t0 )) -lt "${POLL:-560}" ] && [ ! -f "$until_file" ]; do
  sleep 10
  kill -0 "$(cat /tmp/job.pid)" 2>/dev/null || [ -f /tmp/job.done ] || { echo "the job ended without job.done"; break; }
done
echo "--- after $(( $(date +%s) - t0 )) s; build done: $([ -f /tmp/build.done ] && echo yes || echo no); job done: $([ -f /tmp/job.done ] && echo yes || echo no)"
grep -E "^\[|Error|Traceback" /tmp/job.log | tail -30
tail -c 1500 /tmp/job.log
if [ "${RETURN:-pack}" = after ]; then
  tail -c 3000 /tmp/after.log 2>/dev/null
  if [ -d /tmp/after ]; then cp /tmp/after/* "$OUT"/ 2>/dev/null; fi
  cp /tmp/after.log "$OUT"/after.log 2>/dev/null
else
  if [ -d /tmp/pack ]; then cp /tmp/pack/* "$OUT"/ 2>/dev/null; fi
  cp /tmp/job.log "$OUT"/job.log
fi
ls -la "$OUT"
