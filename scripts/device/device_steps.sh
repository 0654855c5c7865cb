# Sourced by the device scripts (device_step_profile.sh, device_throughput_ab.sh): a time budget for one device
# call and commands run within it. The caller sets OUT and BUDGET_S and sources this in the repository root.
t0=$(date +%s)

left() { echo $(( BUDGET_S - ($(date +%s) - t0) )); }

# step NAME MAX_S CMD...: CMD under timeout min(MAX_S, what is left - 5 s), its output also in $OUT/NAME.txt;
# skipped when under 30 s are left.
step() {
    local name=$1 max=$2; shift 2
    local limit=$(( $(left) - 5 ))
    [ "$limit" -gt "$max" ] && limit=$max
    if [ "$limit" -lt 30 ]; then echo "=== $name: skipped ($(left) s of the budget left)"; return; fi
    echo "=== $name (timeout ${limit} s, at $(( $(date +%s) - t0 )) s)"
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUT/$name.txt"
    echo "=== $name: exit ${PIPESTATUS[0]} after $(( $(date +%s) - t0 )) s"
}

# python_ready: the carried wheels (.whl) installed into /tmp/site where pydantic is missing, the GPU and the
# versions printed; fails (4) when python3 still lacks torch, transformers or pydantic.
python_ready() {
    if ! python3 -c "import pydantic" 2>/dev/null && [ -d .whl ]; then
        python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    fi
    nvidia-smi --query-gpu=name,memory.used,utilization.gpu --format=csv,noheader
    python3 -c "import torch, transformers, pydantic; print('torch', torch.__version__, '| transformers', \
transformers.__version__, '| pydantic', pydantic.__version__)" \
        || { echo "FATAL: python3 lacks torch, transformers or pydantic (carry .whl, or set PYTHONPATH)"; return 4; }
}
