"""`hpclaunch status` on a real cluster falls back to accounting (sacct) once squeue has
forgotten a job (MinJobAge, 300 s by default). The local cluster runs slurmdbd on MariaDB, so
that path is exercised for real: sacct must agree with squeue on every final state we map."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from hpclaunch.schedulers.protocol import JobState, SchedulerStatus
from hpclaunch.schedulers.slurm import sacct_status, slurm_status

if TYPE_CHECKING:
    from tests.cluster.conftest import SlurmCluster

pytestmark = pytest.mark.slurm


def wait_sacct(job_id: str, raw: str, timeout: float = 30) -> SchedulerStatus:
    """slurmctld sends records to slurmdbd asynchronously: poll until the final one is there."""
    deadline = time.monotonic() + timeout
    seen = None
    while time.monotonic() < deadline:
        seen = sacct_status(job_id)
        if seen is not None and seen.raw == raw:
            return seen
        time.sleep(0.2)
    raise AssertionError(f"sacct for {job_id}: wanted {raw}, last saw {seen}")


def test_sacct_agrees_with_squeue_on_final_states(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    ok = slurm_cluster.sbatch("-o", "/dev/null", "--wrap", "true", cwd=tmp_path)
    bad = slurm_cluster.sbatch("-o", "/dev/null", "--wrap", "exit 3", cwd=tmp_path)
    held = slurm_cluster.sbatch("-o", "/dev/null", "--wrap", "sleep 300", cwd=tmp_path)
    array = slurm_cluster.sbatch(
        "-o", "/dev/null", "--array=0-1", "--wrap", "exit $SLURM_ARRAY_TASK_ID", cwd=tmp_path
    )
    try:
        assert slurm_cluster.wait_job(held, {"RUNNING"}, timeout=30) == "RUNNING"
    finally:
        slurm_cluster.cancel(held)
    expected = {
        ok: ("COMPLETED", JobState.COMPLETED),
        bad: ("FAILED", JobState.FAILED),
        held: ("CANCELLED", JobState.CANCELLED),
        f"{array}_0": ("COMPLETED", JobState.COMPLETED),
        f"{array}_1": ("FAILED", JobState.FAILED),
    }
    for job, (raw, state) in expected.items():
        from_acct = wait_sacct(job, raw)
        assert from_acct.state is state, (job, from_acct)
        from_queue = slurm_status(job)  # still listed by squeue (MinJobAge), so it answers
        assert (from_queue.state, from_queue.raw) == (state, raw), (job, from_queue)


def test_sacct_keeps_the_requeue_history(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    out = tmp_path / "requeue.out"
    job = slurm_cluster.sbatch(
        "--open-mode=append",
        "-o",
        str(out),
        "--wrap",
        '[ "${SLURM_RESTART_COUNT:-0}" -ge 1 ] && exit 0; sleep 300',
        cwd=tmp_path,
    )
    assert slurm_cluster.wait_job(job, {"RUNNING"}, timeout=30) == "RUNNING"
    slurm_cluster.run("scontrol", "requeue", job)
    assert slurm_cluster.wait_job(job, timeout=60) == "COMPLETED"
    seen = wait_sacct(job, "COMPLETED")
    assert seen.state is JobState.COMPLETED
    assert "requeued 1x" in seen.reason, seen


def test_a_job_sacct_does_not_know_is_none(slurm_cluster: SlurmCluster) -> None:
    assert sacct_status("987654321") is None
