"""Issue 49: every script under bench/ has a smoke mode (``--smoke``: the smallest sizes, seconds)
that ``make test`` runs, so that every README figure's command keeps working: nothing ran the benches,
and a refactor broke ``bench/trainer_overhead.py`` (README's first figure) unseen. Each runs here
with ``--smoke`` and must end well and print its figure's line; their figures mean nothing here.

The GPU lease's scripts (``gpu_lease.sh``, ``gpu_matrix.py``, ``gpu_check.py``, whose ``--smoke`` is
their ``--cpu``) run in ``test_gpu_lease_cpu.py`` and ``test_gpu_check_cpu_path.py``;
``control_plane.py``, ``control_plane_faults.py`` and ``fsops.py`` are ``recovery.py``'s modules."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

BENCH = Path(__file__).resolve().parents[2] / "bench"
# script -> a line its smoke run prints (the figure the README or docs/figures.md quotes)
SMOKE = {
    "trainer_overhead.py": "ratio hpclaunch/bare, median of paired wall",
    "save_threads.py": "blocking save of",
    "step_anatomy.py": "eager:",
    "data_path.py": "with training: in-memory",
    "preflight.py": "ratio with / without",
    "fsdp_vs_ddp.py": "fsdp/ddp: step time",
    "checkpoint_stall.py": "training lost per async save",
    "memory_tier.py": "a snapshot's job",
    "watchdog.py": "total: hang -> the continuation first step",
    "recovery.py": "failed release",
    "restart_cost.py": "total: stop signal -> end of the continuation first step",
}
ELSEWHERE = {
    "gpu_lease.sh": "tests/integration/test_gpu_lease_cpu.py",
    "gpu_matrix.py": "tests/integration/test_gpu_lease_cpu.py",
    "gpu_check.py": "tests/integration/test_gpu_check_cpu_path.py",
    "control_plane.py": "recovery.py --smoke (its agree scenario)",
    "control_plane_faults.py": "recovery.py --smoke (its agree scenario)",
    "fsops.py": "recovery.py --smoke (its agree scenario)",
}


def test_every_bench_script_is_smoked_here_or_named_where() -> None:
    scripts = {p.name for p in BENCH.iterdir() if p.suffix in (".py", ".sh")}
    assert scripts == set(SMOKE) | set(ELSEWHERE)
    for name in [*SMOKE, "gpu_lease.sh", "gpu_matrix.py", "gpu_check.py"]:
        assert "--smoke" in (BENCH / name).read_text(), name


@pytest.mark.parametrize("script", sorted(SMOKE))
def test_the_bench_runs_in_its_smoke_mode(script: str, tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)}
    env.pop("HPCLAUNCH_DEBUG", None)
    proc = subprocess.run(
        [sys.executable, str(BENCH / script), "--smoke"],
        cwd=BENCH.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=580,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert SMOKE[script] in proc.stdout, proc.stdout[-3000:]
