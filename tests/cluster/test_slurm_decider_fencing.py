"""Issue 36, finding 1, on the real local SLURM, 3-node layout (n1, n2 training; n3 a hot spare):
node 0's agent, the decider, is stopped with SIGSTOP (a GC pause, a hung NFS client) for longer
than the heartbeat window, so n2's agent takes the decider's role and the run lock's next epoch.
Then n1's agent is resumed (SIGCONT), while the attempt still runs or after n2 has decided. The
deposed decider writes nothing that only the decider may write: there is exactly one decision, the
run finishes, and its weights are bitwise equal to those of a run never interrupted."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from concurrent.futures import Future
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from tests.cluster.side_by_side import COMMON, SPARE, SideBySide, job_processes_on
from tests.runlib import (
    TINY,
    events,
    final_params_sha,
    hpclaunch,
    last_logged_step,
    synth_data,
    tiny_overrides,
    wait_for,
    wait_run_done,
)

from hpclaunch.rundir import RunLock, RunPaths

if TYPE_CHECKING:
    from tests.cluster.conftest import SlurmCluster

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

TEST = "test_decider_stopped_past_the_window_and_resumed_leaves_one_decision_and_a_finished_run_fencing"
DECISIONS = ("requeued", "finished", "failed", "ended", "cancelled")
RESUMED = ["while-training", "after-the-decision"]
# Long enough a run that the role moves before it ends (the window is 8 s on a loaded machine).
LONGER = ("train.steps=160",)


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("decider-fencing")


@pytest.fixture(scope="module")
def data(work: Path) -> Path:
    return synth_data(work / "data")


def _agent_on(cluster: SlurmCluster, node: str, job_id: str) -> int:
    """The pid of job ``job_id``'s node agent on ``node``."""
    for pid, cmd in job_processes_on(cluster, node, job_id, python_only=True):
        if "hpclaunch.jobs.agent" in cmd:
            return pid
    raise LookupError(f"no agent of job {job_id} on {node}")


def _taken_from(run: Path, pid: int, epoch: int) -> bool:
    """Another agent claimed a later epoch of the run lock than ``pid`` held (the nodes of the
    local cluster share one host name: the pid tells them apart, as their one PID namespace allows)."""
    holder = RunLock(RunPaths(run)).read()
    return holder is not None and holder.epoch > epoch and holder.pid not in (0, pid)


def _stopped_decider(
    cluster: SlurmCluster, work: Path, data: Path, resumed: str
) -> tuple[Path, str, int, dict[str, Any]]:
    """Submitted; n1's agent (the decider) SIGSTOPped at step 25 until n2 took the role (and, for
    ``after-the-decision``, decided), then SIGCONT; its end. The run, its job and the epoch n2 took."""
    run = work / "runs" / f"stopped-decider-{resumed}"
    steps = LONGER if resumed == "while-training" else ()
    hpclaunch(
        "submit",
        str(TINY),
        *tiny_overrides(work, data, run.name, *COMMON, SPARE, *steps),
        "--no-preflight",
        cwd=work,
    )
    job = next(str(e["job_id"]) for e in events(run) if e["event"] == "submitted")
    wait_for(lambda: last_logged_step(run) >= 25, timeout=300, poll=0.2, what=f"{run.name} at step 25")
    decider = _agent_on(cluster, "n1", job)
    held = RunLock(RunPaths(run)).read()
    assert held is not None and held.pid == decider, (held, decider)  # n1's agent holds the run
    os.kill(decider, signal.SIGSTOP)
    try:
        # n2 saw n1's counter unchanged for the window and claimed the lock's next epoch.
        wait_for(
            lambda: _taken_from(run, decider, held.epoch),
            timeout=300,
            poll=0.5,
            what="n2 takes the role over",
        )
        taken = RunLock(RunPaths(run)).read()
        taken_epoch = taken.epoch if taken is not None else held.epoch + 1
        if resumed == "after-the-decision":
            wait_for(
                lambda: any(e["event"] in DECISIONS for e in events(run)),
                timeout=600,
                poll=0.5,
                what="n2's decision",
            )
    finally:
        os.kill(decider, signal.SIGCONT)
    return run, job, taken_epoch, wait_run_done(run, work, timeout=600)


def _reference_longer(work: Path, data: Path) -> str:
    """The longer run never interrupted."""
    run = work / "runs" / "reference-160"
    sets = tiny_overrides(work, data, run.name, *COMMON, *LONGER, "testing.step_sleep_s=0")
    hpclaunch("submit", str(TINY), *sets, "--no-preflight", cwd=work)
    r = wait_run_done(run, work, timeout=600)
    assert r["state"] == "finished", json.dumps(r, indent=1)[-2000:]
    return final_params_sha(run)


@pytest.fixture(scope="module")
def runs(
    request: pytest.FixtureRequest,
    slurm_cluster_3nodes: SlurmCluster,
    work: Path,
    data: Path,
    common_reference: Future[str],
) -> Iterator[SideBySide]:
    with SideBySide(request) as runs:
        for resumed in RESUMED:
            runs.start(
                resumed,
                partial(_stopped_decider, slurm_cluster_3nodes, work, data, resumed),
                for_tests=(f"{TEST}[{resumed}]",),
            )
        runs.start(
            "reference-160", partial(_reference_longer, work, data), for_tests=(f"{TEST}[while-training]",)
        )
        yield runs


@pytest.mark.parametrize("resumed", RESUMED)
def test_decider_stopped_past_the_window_and_resumed_leaves_one_decision_and_a_finished_run_fencing(
    slurm_cluster_3nodes: SlurmCluster, runs: SideBySide, common_reference: Future[str], resumed: str
) -> None:
    run, job, taken_epoch, s = runs.result(resumed)
    assert s["state"] == "finished", json.dumps(s, indent=1)[-3000:]
    decided = [e for e in events(run) if e["event"] in DECISIONS]
    assert [e["event"] for e in decided] == ["finished"], decided  # one decision
    published = json.loads((run / "attempts" / decided[0]["attempt"] / "decision.json").read_text())
    assert published["action"] == "finish" and published["epoch"] >= taken_epoch, (published, taken_epoch)
    if resumed == "after-the-decision" or published["by"] == "n2":
        assert (published["by"], decided[0]["node"]) == ("n2", 1), published  # n2 decided under its epoch
    else:
        # n1, resumed while training, was the first live agent again and claimed the role anew: its
        # decision carries a later epoch than the one n2 took (a deposed decider writes nothing).
        assert published["by"] == "n1" and published["epoch"] > taken_epoch, (published, taken_epoch)
    assert RunLock(RunPaths(run)).read() is None  # released once, by the one that decides
    assert slurm_cluster_3nodes.wait_job(job, timeout=120) == "COMPLETED"
    log = "\n".join(p.read_text(errors="replace") for p in (run / "scheduler").rglob("*_log.out"))
    assert "node n2 decides from now on" in log, log[-3000:]
    assert "node n1 was deposed as the decider" in log or published["by"] == "n1", log[-3000:]
    reference = runs.result("reference-160") if resumed == "while-training" else common_reference.result()
    assert final_params_sha(run) == reference
