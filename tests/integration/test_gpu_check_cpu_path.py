"""``bench/gpu_check.py --cpu``: the GPU check's code path on the CPU (tiny model, fp32, FSDP2 on a
one-rank gloo group), so that it runs as written when a GPU machine is lent. Its figures mean
nothing here; what is checked is that every part produces its result."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).parents[2] / "bench" / "gpu_check.py"


def test_gpu_check_runs_every_part_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "gpu-check.json"
    cmd = [
        sys.executable,
        str(SCRIPT),
        "--cpu",
        "--steps",
        "4",
        "--flash",
        "false",
        "--out",
        str(out),
        "--tmp",
        str(tmp_path),
    ]
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=600,
        env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["cpu"] is True and r["nproc"] == 1 and r["devices"] == []
    t = r["throughput"]
    assert t["parameters"] > 0 and t["flops_per_step"] > 0 and t["step_s"] > 0 and t["mfu"] is None
    assert r["memory"]["peak_gb_rank0"] > 0 and r["memory"]["estimate_gb"] > 0
    c = r["checkpoint"]
    assert c["async_stall_s"] is not None and c["blocking_s"] is not None and c["bytes"] > 0
    for writer in ("process", "thread"):  # both writers, each in its own run
        w = c["writers"][writer]
        assert w["async_stall_s"] is not None and w["blocking_s"] is not None and w["bytes"] > 0
        assert f"{writer} writer: async save stalled training" in proc.stdout
    d = r["determinism"]["flash_attn=false"]
    assert d == {"same_seed_bitwise": True, "stopped_at": d["stopped_at"], "resume_bitwise": True}
    assert 2 <= d["stopped_at"] < 4
    assert "MFU n/a" in proc.stdout and "resumed bitwise True" in proc.stdout
