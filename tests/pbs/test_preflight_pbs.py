"""Preflight's scheduler check against the real OpenPBS: queues, their walltime limits and
kill_delay, the preemption method, and what a `select` asks of the nodes, all read from the
server's own JSON before anything is submitted."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from hpclaunch.config import RunConfig
from hpclaunch.preflight import Status, run_login_checks

if TYPE_CHECKING:
    from tests.pbs.conftest import PbsServer

pytestmark = pytest.mark.pbs


@pytest.fixture
def real_pbs_first(monkeypatch: pytest.MonkeyPatch, pbs_server: PbsServer) -> None:
    """The check runs in this process: put real PBS before Slurm's Torque emulation for it only."""
    monkeypatch.setenv("PATH", f"/opt/pbs/bin:{Path('/usr/local/bin')}:/usr/bin:/bin")


def scheduler_check(tmp_path: Path, **scheduler: Any) -> Any:
    scheduler.setdefault("kind", "pbs")
    cfg = RunConfig.model_validate({"name": "pf", "scheduler": scheduler}).resolved(tmp_path)
    return run_login_checks(cfg, only={"scheduler"}).get("scheduler")


def test_default_queue_limits_and_preemption(
    real_pbs_first: None, pbs_server: PbsServer, tmp_path: Path
) -> None:
    check = scheduler_check(tmp_path)
    assert check.status is Status.PASS, check
    assert check.finding.startswith(
        f"PBS 23.06.06: queue workq (default), no max walltime, kill_delay {pbs_server.kill_delay_s} s"
    )
    assert "1 node(s) can take a chunk of select=1:ncpus=3:mpiprocs=1" in check.finding
    assert check.finding.endswith("reruns: the job is submitted rerunnable (-r y), preempt_order SCR")


def test_queue_that_does_not_exist(real_pbs_first: None, tmp_path: Path) -> None:
    check = scheduler_check(tmp_path, partition="shrt")
    assert check.status is Status.FAIL
    assert check.finding == "queue 'shrt' does not exist (did you mean short?); queues: workq, short"


def test_walltime_beyond_the_queue_maximum(real_pbs_first: None, tmp_path: Path) -> None:
    check = scheduler_check(tmp_path, partition="short", time_limit="00:10:00")
    assert check.status is Status.FAIL
    assert (
        "scheduler.time_limit 00:10:00 exceeds queue short's resources_max.walltime 00:05:00" in check.finding
    )


def test_kill_delay_shorter_than_a_save_is_named(real_pbs_first: None, tmp_path: Path) -> None:
    check = scheduler_check(tmp_path, partition="short", time_limit="2m")
    assert check.status is Status.WARN, check
    assert "queue short's kill_delay 1 s is shorter than a checkpoint save (~2 s" in check.finding
    assert "qdel, qrerun or a preemption kills the job before its stop save ends" in check.finding


def test_select_asking_for_more_gpus_than_a_node_has(real_pbs_first: None, tmp_path: Path) -> None:
    check = scheduler_check(tmp_path, gpus_per_node=4)
    assert check.status is Status.FAIL
    assert check.finding.startswith(
        "no node can take select=1:ncpus=12:ngpus=4:mpiprocs=1: ngpus 4 > pbshead's 2"
    ), check.finding
    assert scheduler_check(tmp_path, gpus_per_node=2).status is Status.PASS


def test_more_nodes_than_the_server_has(real_pbs_first: None, tmp_path: Path) -> None:
    check = scheduler_check(tmp_path, nodes=2)
    assert check.status is Status.FAIL
    assert "1 node(s) can take a chunk of select=2:ncpus=3:mpiprocs=1; the run asks for 2" in check.finding
