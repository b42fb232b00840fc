"""``bash bench/gpu_lease.sh --cpu``: the lease's every part on the CPU (tiny model, fp32), so that the
script a short GPU lease runs cannot rot between leases. Its figures mean nothing here; checked:
each part ends well and writes what the lease brings back, and the deterministic mode's run,
stopped and resumed, is bitwise equal to the uninterrupted one (the determinism part: compiled on a
GPU, eager here, where the matrix's compiled row is what compiles)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # inductor compiles the tiny model's block on the CPU (about a minute)

ROOT = Path(__file__).parents[2]
SUMMARY_KEYS = {"gpu", "params", "deterministic", "compile", "micro_batch", "step_s", "mfu", "peak_memory_gb"}


def test_the_lease_script_runs_every_part_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(tmp_path),
        "OUT": str(out),
        "WORK": str(tmp_path / "work"),
        "PYTHON": sys.executable,
        "BUDGET_S": "1500",
        "LIMIT_SCALE": "4",  # each part's GPU-sized limit, four times over: CI's cores are busy
        "OMP_NUM_THREADS": "1",
        # one cache for the whole script: the determinism part's runs compile what the first compiled
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
    }
    proc = subprocess.run(
        ["bash", "bench/gpu_lease.sh", "--cpu"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1700,
    )
    log = (out / "lease.log").read_text() if (out / "lease.log").exists() else ""
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:] + log[-3000:]
    for part in ("env", "matrix", "preflight", "determinism"):
        assert f"=== {part}: exit 0" in log, log[-4000:]

    summary = json.loads((out / "summary.json").read_text())
    assert [row["name"] for row in summary] == ["cpu-fast-compiled", "cpu-det-eager"]
    for row in summary:
        assert "error" not in row and row.keys() >= SUMMARY_KEYS, row
        assert row["gpu"] == "cpu" and row["step_s"] > 0 and row["mfu"] is None
    assert [row["compile"] for row in summary] == [True, False]
    assert [row["deterministic"] for row in summary] == [False, True]
    profiles = json.loads((out / "profiles.json").read_text())
    assert profiles["cpu-fast-compiled"]["steps"] == 2 and profiles["cpu-fast-compiled"]["aten_ops"] > 0

    checks = {c["name"]: c["status"] for c in json.loads((out / "preflight.json").read_text())["checks"]}
    assert checks["config"] == "pass" and checks["data"] == "pass", checks

    d = json.loads((out / "determinism.json").read_text())["determinism"]["flash_attn=true"]
    assert d["same_seed_bitwise"] is True and d["resume_bitwise"] is True, d
    assert 1 <= d["stopped_at"] < 8
