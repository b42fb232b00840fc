#!/usr/bin/env bash
# Everything that needs CUDA, in one bounded script for a short lease on a GPU machine, most
# important first; each part has its own time limit, so a slow one costs only itself.
#
#   bash bench/gpu_lease.sh            # from the repository root, with python3 holding CUDA torch
#
# Where the machine lacks this project's pure-Python dependencies, put their wheels in .whl/
# (docs/figures.md, "How to measure", says which); they are installed to /tmp/site. Logs and JSON go to
# $OUT (default /tmp/gpu-lease): lease.log (everything), gpu-check-mid.json, gpu-check-1b.json,
# preflight.json.
set -u
OUT=${OUT:-/tmp/gpu-lease}
BUDGET_S=${BUDGET_S:-560}
# PARTS=env,preflight,gpu-check-mid,hang-test,gpu-check-1b picks parts (default: all)  # the whole script; a part gets what is left if that is less than its own limit
# Run directories in memory when there is room: the checkpoints of ~9 runs are written and removed.
if [ -z "${WORK:-}" ]; then
    WORK=/tmp/gpu-lease-work
    [ "$(df -BG --output=avail /dev/shm 2>/dev/null | tail -1 | tr -dc 0-9)" -ge 48 ] 2>/dev/null &&
        WORK=/dev/shm/gpu-lease-work
fi
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

part() {  # part NAME LIMIT_S COMMAND...: run bounded, log, and say how it ended
    local name=$1 limit=$2
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

part env 40 bash -c '
    nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap,clocks.max.sm --format=csv
    python3 -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0), torch.cuda.is_bf16_supported(), torch.cuda.nccl.version())"
    python3 -c "import hpclaunch, mmdit, pydantic, submitit; print(\"imports ok\")"
    nproc; free -g | head -2; df -h /tmp /dev/shm | tail -2'

# Preflight on the GPU node: the real nvidia-smi parse, the probe's CUDA view, the measured estimate.
part preflight 90 bash -c "
    python3 -m hpclaunch data synth $WORK/data --samples 256 --config examples/tiny.yaml &&
    python3 -m hpclaunch preflight examples/tiny.yaml --json \
        --set scheduler.gpus_per_node=1 --set scheduler.procs_per_node=1 --set train.precision=bf16 \
        --set data.token_dir=$WORK/data/tokens --set data.latent_dir=$WORK/data/latents \
        --set run_dir=$WORK/preflight-run > $OUT/preflight.json; rc=\$?;
    python3 -c \"import json; r=json.load(open('$OUT/preflight.json')); [print(c['name'], c['status'], '|', c['finding'], '|', c.get('hint') or '') for c in r['checks']]; print('estimate:', json.dumps(r.get('estimate'))[:600])\"; exit \$rc"

# A ~0.2B MMDiT, bf16 FSDP2: throughput, async checkpoint stall (process and thread writers),
# determinism (same seed twice; stopped and resumed) with flash attention off and on.
MID=(--set model.depth=8 --set model.dim_text=768 --set model.dim_latent=768 --set model.heads=12)
part gpu-check-mid 260 python3 bench/gpu_check.py --steps 20 --tmp "$WORK" --out "$OUT/gpu-check-mid.json" \
    "${MID[@]}" --set checkpoint.every_steps=10 --set checkpoint.keep_last=1

# The GPU hang test: an NCCL rank's hang dumps torch's flight record.
part hang-test 110 python3 -m pytest -q -p no:cacheprovider tests/integration/test_hangs_gpu.py \
    --basetemp "$WORK/pytest"

# The ~1.1B config (bench/gpu_check.py CONFIG_1B): throughput and peak memory only, one final save.
part gpu-check-1b 150 python3 bench/gpu_check.py --steps 16 --parts '' --tmp "$WORK" \
    --out "$OUT/gpu-check-1b.json" --set checkpoint.every_steps=1000 --set checkpoint.keep_last=1

echo "=== summary (+$(($(date +%s) - T0))s)"
grep -E "^=== |^gpu check|^  " "$LOG" | grep -v "^=== summary" | tail -40
