#!/usr/bin/env bash
# Everything that needs CUDA, in one bounded script for a short lease on a GPU machine, most
# important first; each part has its own time limit, so a slow one costs only itself.
#
#   bash bench/gpu_lease.sh            # from the repository root, with python3 holding CUDA torch
#   bash bench/gpu_lease.sh --cpu      # the same parts' code paths on the CPU (tiny model; no figures; --smoke too)
#
# Where the machine lacks this project's pure-Python dependencies, put their wheels in .whl/
# (docs/figures.md, "How to measure", says which); they are installed to /tmp/site. Logs and JSON go
# to $OUT (default /tmp/gpu-lease): lease.log (everything), summary.json and profiles.json (the
# step's matrix, bench/gpu_matrix.py), preflight.json. Commit them under bench/results/<date>-<gpu>/.
set -u
OUT=${OUT:-/tmp/gpu-lease}
BUDGET_S=${BUDGET_S:-480}
CPU=""
# --smoke is --cpu: the smallest sizes, the code paths only (make test runs it: test_gpu_lease_cpu.py)
[ "${1:-}" = "--cpu" ] || [ "${1:-}" = "--smoke" ] && CPU="--cpu"
# PARTS=env,matrix,preflight,determinism picks parts (default: all); a part gets what is left of
# BUDGET_S if that is less than its own limit. LIMIT_SCALE (default 1) multiplies every part's limit:
# the CPU run on a loaded 2-core machine (the test) compiles for minutes, not a GPU's seconds.
LIMIT_SCALE=${LIMIT_SCALE:-1}
if [ -z "${WORK:-}" ]; then
    WORK=/tmp/gpu-lease-work
    [ "$(df -BG --output=avail /dev/shm 2>/dev/null | tail -1 | tr -dc 0-9)" -ge 48 ] 2>/dev/null &&
        WORK=/dev/shm/gpu-lease-work
fi
export WORK
mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
if compgen -G ".whl/*.whl" >/dev/null && [ -z "$CPU" ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
LOG="$OUT/lease.log"
T0=$(date +%s)

part() {  # part NAME LIMIT_S COMMAND...: run bounded, log, and say how it ended
    local name=$1 limit=$(($2 * LIMIT_SCALE))
    shift 2
    case ",${PARTS:-all}," in *",$name,"* | ",all,") ;; *) return ;; esac
    local start left
    start=$(date +%s)
    left=$((BUDGET_S - (start - T0) - 5))
    if [ "$left" -lt 20 ]; then
        echo "=== $name: skipped, ${left}s of the budget left" | tee -a "$LOG"
        return
    fi
    [ "$left" -lt "$limit" ] && limit=$left
    echo "=== $name (limit ${limit}s, at +$((start - T0))s, in $WORK)" | tee -a "$LOG"
    timeout -k 10 "$limit" "$@" >>"$LOG" 2>&1
    local rc=$?
    echo "=== $name: exit $rc after $(($(date +%s) - start))s" | tee -a "$LOG"
}

part env 30 bash -c "
    nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap,clocks.max.sm --format=csv 2>&1 | head -3
    $PY -c 'import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.is_available() and torch.cuda.get_device_name(0))'
    $PY -c 'import hpclaunch, mmdit, pydantic, submitit; print(\"imports ok\")'
    nproc; free -g | head -2; uptime"

# The step: kernel mode x compilation x model size x micro-batch (bench/gpu_matrix.py's order).
# (its per-configuration limit scales too: a compile on CI's busy cores outlasted 150 s)
part matrix $((BUDGET_S - 80)) $PY bench/gpu_matrix.py $CPU --out "$OUT" --budget-s $((BUDGET_S - 90)) \
    --limit-s $((100 * LIMIT_SCALE))

# Preflight on the GPU node: the real nvidia-smi parse, the probe's CUDA view, the memory estimate
# and the largest micro-batch it says fits.
GPU_SETS="--set scheduler.gpus_per_node=1 --set train.precision=bf16"
[ -n "$CPU" ] && GPU_SETS=""
part preflight 60 bash -c "
    $PY -m hpclaunch data synth $WORK/data --samples 64 --config examples/tiny.yaml >/dev/null &&
    $PY -m hpclaunch preflight examples/tiny.yaml --json $GPU_SETS --set scheduler.procs_per_node=1 \
        --set data.token_dir=$WORK/data/tokens --set data.latent_dir=$WORK/data/latents \
        --set run_dir=$WORK/preflight-run > $OUT/preflight.json; rc=\$?;
    $PY -c \"import json; r=json.load(open('$OUT/preflight.json')); [print(c['name'], c['status'], '|', c['finding']) for c in r['checks']]\"; exit \$rc"

# Determinism on the GPU, 0.2B in the deterministic mode, compiled: the same seed twice and a run
# stopped halfway and resumed, compared bitwise (weights, AdamW state, EMA).
# On the CPU (--cpu) eager: the matrix's compiled row covers compiling there, and inductor's CPU
# compiles of three runs cost CI minutes on busy cores; the GPU run is compiled, as it trains.
MID=(--set model.depth=8 --set model.dim_text=768 --set model.dim_latent=768 --set model.heads=12)
COMPILE=true
[ -n "$CPU" ] && MID=() && COMPILE=false
part determinism 150 $PY bench/gpu_check.py $CPU --steps 8 --parts determinism --flash true --tmp "$WORK" \
    --out "$OUT/determinism.json" "${MID[@]}" --set train.compile=$COMPILE --set train.activation_checkpointing=false \
    --set checkpoint.keep_last=1

echo "=== summary (+$(($(date +%s) - T0))s)"
grep -E "^=== |^[0-9a-z.]+-(fast|det)-|^gpu check|^  " "$LOG" | grep -v "^=== summary" | tail -40
