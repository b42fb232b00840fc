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
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

import psutil
import pytest
from tests.cluster.test_slurm_in_place import COMMON, SPARE
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

DECISIONS = ("requeued", "finished", "failed", "ended", "cancelled")


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("decider-fencing")


@pytest.fixture(scope="module")
def data(work: Path) -> Path:
    return synth_data(work / "data")


def _agent_on(cluster: SlurmCluster, node: str, job_id: str) -> int:
    """The pid of job ``job_id``'s node agent on ``node`` (its environment says which job it is)."""
    ns = f"hpcl{cluster.nodes.index(node) + 1}"
    pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, check=True).stdout
    mine = f"SLURM_JOB_ID={job_id}".encode()
    for pid in map(int, pids.split()):
        try:
            cmd = " ".join(psutil.Process(pid).cmdline())
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except (psutil.Error, OSError):
            continue
        if "hpclaunch.jobs.agent" in cmd and mine in env and "python" in cmd.split(" ")[0]:
            return pid
    raise LookupError(f"no agent of job {job_id} on {node}")


def _taken_from(run: Path, pid: int, epoch: int) -> bool:
    """Another agent claimed a later epoch of the run lock than ``pid`` held (the nodes of the
    local cluster share one host name: the pid tells them apart, as their one PID namespace allows)."""
    holder = RunLock(RunPaths(run)).read()
    return holder is not None and holder.epoch > epoch and holder.pid not in (0, pid)


@pytest.mark.parametrize("resumed", ["while-training", "after-the-decision"])
def test_decider_stopped_past_the_window_and_resumed_leaves_one_decision_and_a_finished_run_fencing(
    slurm_cluster_3nodes: SlurmCluster, work: Path, data: Path, resumed: str
) -> None:
    cluster = slurm_cluster_3nodes
    run = work / "runs" / f"stopped-decider-{resumed}"
    # Long enough a run that the role moves before it ends (the window is 8 s on a loaded machine).
    steps = ("train.steps=160",) if resumed == "while-training" else ()
    hpclaunch(
        "submit",
        str(TINY),
        *tiny_overrides(work, data, run.name, *COMMON, SPARE, *steps),
        "--no-preflight",
        cwd=work,
    )
    job = next(str(e["job_id"]) for e in events(run) if e["event"] == "submitted")
    wait_for(lambda: last_logged_step(run) >= 25, timeout=300, poll=0.2, what="step 25")
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
    s = wait_run_done(run, work, timeout=600)
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
    assert cluster.wait_job(job, timeout=120) == "COMPLETED"
    log = "\n".join(p.read_text(errors="replace") for p in (run / "scheduler").rglob("*_log.out"))
    assert "node n2 decides from now on" in log, log[-3000:]
    assert "node n1 was deposed as the decider" in log or published["by"] == "n1", log[-3000:]
    assert final_params_sha(run) == reference(work, data, steps)


def reference(work: Path, data: Path, extra: tuple[str, ...]) -> str:
    """The same run never interrupted (once per configuration)."""
    run = work / "runs" / ("reference" + "".join(f"-{x.split('=')[1]}" for x in extra))
    if not run.exists():
        hpclaunch(
            "submit",
            str(TINY),
            *tiny_overrides(work, data, run.name, *COMMON, *extra),
            "--no-preflight",
            cwd=work,
        )
    r = wait_run_done(run, work, timeout=600)
    assert r["state"] == "finished", json.dumps(r, indent=1)[-2000:]
    return final_params_sha(run)
