"""Preflight against the real local SLURM: the scheduler check reads the real ``sinfo`` / Torque
``qstat -Q``, and the node checks run inside a real allocation from its own SLURM environment."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from hpclaunch.config import RunConfig
from hpclaunch.preflight import Status, run_login_checks

if TYPE_CHECKING:  # the fixtures' type; conftest modules are not importable by name
    from tests.cluster.conftest import SlurmCluster

pytestmark = pytest.mark.slurm


def scheduler_check(tmp_path: Path, **scheduler: Any):
    scheduler.setdefault("kind", "slurm")
    cfg = RunConfig.model_validate({"name": "pf", "scheduler": scheduler}).resolved(tmp_path)
    return run_login_checks(cfg, only={"scheduler"}).get("scheduler")


def test_partition_that_does_not_exist(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    check = scheduler_check(tmp_path, partition="gpu-large")
    assert check.status is Status.FAIL
    assert check.finding.startswith("partition 'gpu-large' does not exist")
    assert "partitions: debug, short" in check.finding


def test_time_limit_beyond_partition_maxtime(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    limit = f"00:{slurm_cluster.short_max_minutes + 5:02d}:00"
    check = scheduler_check(tmp_path, partition="short", time_limit=limit)
    assert check.status is Status.FAIL
    assert f"exceeds partition short's MaxTime 00:{slurm_cluster.short_max_minutes:02d}:00" in check.finding
    ok = scheduler_check(tmp_path, partition="short", time_limit="2m")
    assert ok.status is Status.PASS, ok


def test_default_partition_and_node_count(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    check = scheduler_check(tmp_path)
    assert check.status is Status.PASS, check
    assert check.finding.startswith("partition debug (default): 1 node(s) up, no MaxTime")
    too_many = scheduler_check(tmp_path, nodes=2)
    assert too_many.status is Status.FAIL and "has 1 node(s); the run asks for 2" in too_many.finding
    gpus = scheduler_check(tmp_path, gpus_per_node=1)
    assert gpus.status is Status.FAIL and "has 0 node(s) with >= 1 GPUs (gres)" in gpus.finding
    excluded = scheduler_check(tmp_path, exclude=[slurm_cluster.nodes[0]])
    assert excluded.status is Status.FAIL and f"outside exclude {slurm_cluster.nodes[0]}" in excluded.finding


def test_pbs_queue_through_torque_qstat(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    assert scheduler_check(tmp_path, kind="pbs", partition="short").status is Status.PASS
    check = scheduler_check(tmp_path, kind="pbs", partition="shrt")
    assert (
        check.status is Status.FAIL and "queue 'shrt' does not exist (did you mean short?)" in check.finding
    )


NODE_JOB = """\
import json, os, sys
from hpclaunch.config import RunConfig
from hpclaunch.schedulers.slurm import node_context_from_env
from hpclaunch.preflight import run_node_checks

cfg = RunConfig.model_validate({"name": "pf"})
report = run_node_checks(cfg, node_context_from_env(os.environ), only={"node", "network"})
print(json.dumps({"where": report.where, **report.to_json()}))
"""


def run_node_job(cluster: SlurmCluster, tmp_path: Path, marker_dir: Path) -> dict[str, Any]:
    script = tmp_path / "node_checks.py"
    script.write_text(NODE_JOB)
    out = tmp_path / "out.json"
    job = cluster.sbatch(
        "-o",
        str(out),
        f"--export=ALL,HPCLAUNCH_NODE_MARKER_DIR={marker_dir}",
        "--wrap",
        f"{sys.executable} {script}",
        cwd=tmp_path,
    )
    state = cluster.wait_job(job, timeout=60)
    assert state == "COMPLETED", (state, out.read_text() if out.exists() else "")
    return json.loads(out.read_text().strip().splitlines()[-1])


def test_node_checks_inside_a_real_allocation(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    node = slurm_cluster.nodes[0]
    markers = tmp_path / "markers"
    markers.mkdir()
    report = run_node_job(slurm_cluster, tmp_path, markers)
    assert report["where"] == f"node {node}" and report["ok"], report
    (markers / f"unhealthy-{node}").write_text("fan failure\n")
    report = run_node_job(slurm_cluster, tmp_path, markers)
    assert report["ok"] is False
    failed = [c for c in report["checks"] if c["status"] == "fail"]
    assert [c["name"] for c in failed] == ["node"]
    assert failed[0]["finding"] == f"marked unhealthy by {markers}/unhealthy-{node}: fan failure"
