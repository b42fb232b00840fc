#!/usr/bin/env bash
# The first look at the step on a GPU (issue 35), before any change to the step: the 1.16B config
# as it runs today (deterministic, flash off, activation checkpointing, micro-batch 8 x 2), then the
# same model in the fast kernel mode eager and compiled, each with a torch.profiler summary of two
# steps. Bounded: BUDGET_S in all, each part its own limit. Logs and JSON to $OUT.
set -u
OUT=${OUT:-/tmp/gpu-explore}
BUDGET_S=${BUDGET_S:-300}
WORK=/dev/shm/gpu-explore-work
mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
LOG="$OUT/lease.log"
T0=$(date +%s)
part() {  # part NAME LIMIT_S COMMAND...
    local name=$1 limit=$2 start left
    shift 2
    start=$(date +%s)
    left=$((BUDGET_S - (start - T0) - 5))
    if [ "$left" -lt 20 ]; then echo "=== $name: skipped, ${left}s left" | tee -a "$LOG"; return; fi
    [ "$left" -lt "$limit" ] && limit=$left
    echo "=== $name (limit ${limit}s, at +$((start - T0))s)" | tee -a "$LOG"
    timeout -k 10 "$limit" "$@" >>"$LOG" 2>&1
    echo "=== $name: exit $? after $(($(date +%s) - start))s" | tee -a "$LOG"
}
part env 30 bash -c '
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
    python3 -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))"
    python3 -c "import hpclaunch, mmdit, pydantic, submitit; print(\"imports ok\")"; nproc'
CHECK=(python3 bench/gpu_check.py --steps 12 --parts '' --tmp "$WORK" --set checkpoint.every_steps=1000
    --set checkpoint.keep_last=1 --set train.profile.start=8 --set train.profile.steps=2)
FAST=(--set train.deterministic=false --set model.flash_attn=true --set train.activation_checkpointing=false
    --set train.micro_batch=16)
part base-1b 75 "${CHECK[@]}" --out "$OUT/base-1b.json"
part fast-eager-1b 60 "${CHECK[@]}" "${FAST[@]}" --out "$OUT/fast-eager-1b.json"
part fast-compiled-1b 150 "${CHECK[@]}" "${FAST[@]}" --set train.compile=true --out "$OUT/fast-compiled-1b.json"
echo "=== summary (+$(($(date +%s) - T0))s)"
grep -E "^=== |^gpu check|^  " "$LOG" | tail -30
