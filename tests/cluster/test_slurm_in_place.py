"""Issues 17 and 24 on the real local SLURM, 3-node layout (n1, n2 training; n3 a hot spare): a
crash, a hang and a dead node are recovered inside the allocation, with no requeue and one job id
(a hang and a dead node taken by the spares: tests/cluster/test_slurm_script.py, on a user's script);
with no spare left a dead node is kept off by a new job, as before. Issue 24: node 0's agent and
ranks dying is recovered in place (another agent takes the decider's role), a node whose check
fails after a crash is replaced by the spare, and a hang after node 0 left the roster is still
found. Every run ends bitwise equal to one that was never interrupted."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil
import pytest
from tests.runlib import (
    TINY,
    attempt_ids,
    events,
    final_params_sha,
    hpclaunch,
    kill_together,
    last_logged_step,
    synth_data,
    tiny_overrides,
    wait_for,
    wait_run_done,
)

if TYPE_CHECKING:
    from tests.cluster.conftest import SlurmCluster

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

STEPS = 80
COMMON = (
    "scheduler.kind=slurm",
    "scheduler.nodes=2",  # tiny: 2 ranks per node, world size 4
    f"train.steps={STEPS}",
    "train.log_every=1",
    "testing.step_sleep_s=0.15",
    "checkpoint.every_steps=20",
    "scheduler.max_failure_retries=2",
    "scheduler.time_limit=00:10:00",
)
SPARE = "scheduler.spare_nodes=1"


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("in-place")


@pytest.fixture(scope="module")
def data(work: Path) -> Path:
    return synth_data(work / "data")


@pytest.fixture(scope="module")
def reference(slurm_cluster_3nodes: SlurmCluster, work: Path, data: Path) -> str:
    """The same run, never interrupted, on two nodes of the same cluster."""
    hpclaunch(
        "submit", str(TINY), *tiny_overrides(work, data, "reference", *COMMON), "--no-preflight", cwd=work
    )
    s = wait_run_done(work / "runs" / "reference", work, timeout=600)
    assert s["state"] == "finished", json.dumps(s, indent=1)[-2000:]
    return final_params_sha(work / "runs" / "reference")


def _submit(work: Path, data: Path, name: str, *extra: str) -> Path:
    hpclaunch(
        "submit", str(TINY), *tiny_overrides(work, data, name, *COMMON, *extra), "--no-preflight", cwd=work
    )
    return work / "runs" / name


def _rank_on(run: Path, node: str) -> psutil.Process:
    """A running rank of the current attempt on ``node`` (the pid its progress heartbeat names)."""

    def found() -> psutil.Process | None:
        from hpclaunch.rundir import RunPaths
        from hpclaunch.rundir.progress_files import read_progress

        attempt = attempt_ids(run)[-1]
        for _, record in sorted(read_progress(RunPaths(run), attempt).items()):
            if record.node == node and record.pid:
                return psutil.Process(record.pid)
        return None

    return wait_for(found, timeout=120, poll=0.2, what=f"a rank on {node}")


def _kill_node(cluster: SlurmCluster, node: str, *, python_only: bool = False) -> list[str]:
    """Every process of the job on ``node`` (agent, rank host, forkserver, ranks, loader workers):
    those in the node's network namespace but SLURM's own daemons; ``python_only``: the agent and
    what it started only (the batch script and srun live on, as when only the agent is OOM-killed)."""
    ns = f"hpcl{cluster.nodes.index(node) + 1}"
    pids = subprocess.run(
        ["ip", "netns", "pids", ns], capture_output=True, text=True, check=True
    ).stdout.split()
    found = []
    for pid in map(int, pids):
        try:
            cmd = " ".join(psutil.Process(pid).cmdline())
        except psutil.Error:
            continue
        # (srun's own command line names python too: only a python process itself is the agent's)
        if "slurmd" in cmd or "slurmstepd" in cmd or (python_only and "python" not in cmd.split(" ")[0]):
            continue
        found.append((pid, cmd[:60]))
    return kill_together(found)


def _one_job_no_requeue(cluster: SlurmCluster, run: Path) -> str:
    jobs = {str(e["job_id"]) for e in events(run) if e["event"] == "started"}
    assert len(jobs) == 1, jobs
    (job,) = jobs
    assert cluster.job_info(job)["Restarts"] == "0"
    sacct = subprocess.run(
        ["sacct", "-n", "-X", "-j", job, "--format=JobID,State"], capture_output=True, text=True, check=False
    ).stdout
    assert "REQUEUE" not in sacct, sacct
    return job


def _decisions(run: Path) -> list[dict[str, Any]]:
    return [e for e in events(run) if e["event"] == "requeued"]


def test_a_crash_on_a_worker_node_then_on_the_head_restarts_in_place(
    slurm_cluster_3nodes: SlurmCluster, work: Path, data: Path, reference: str
) -> None:
    """(a): a rank SIGKILLed on the non-head training node, and later one on the head node."""
    run = _submit(work, data, "crashes", SPARE)
    wait_for(lambda: last_logged_step(run) >= 25, timeout=300, poll=0.2, what="step 25")
    _rank_on(run, "n2").send_signal(signal.SIGKILL)
    wait_for(
        lambda: len(attempt_ids(run)) >= 2 and last_logged_step(run) >= 45,
        timeout=300,
        poll=0.2,
        what="step 45",
    )
    _rank_on(run, "n1").send_signal(signal.SIGKILL)
    s = wait_run_done(run, work, timeout=600)
    assert s["state"] == "finished", json.dumps(s, indent=1)[-3000:]
    assert [(a["end"], a["cause"]) for a in s["attempts"]] == [
        ("restarted in place", "crash"),
        ("restarted in place", "crash"),
        ("finished", None),
    ]
    assert [(d["in_place"], d["counts_as"]) for d in _decisions(run)] == [(True, "crash")] * 2
    _one_job_no_requeue(slurm_cluster_3nodes, run)
    assert final_params_sha(run) == reference


def test_a_dead_node_without_a_spare_is_kept_off_by_a_new_job(
    slurm_cluster_3nodes: SlurmCluster, work: Path, data: Path, reference: str
) -> None:
    """(d): the same with no spare: SLURM continues the run as a new job without n2."""
    run = _submit(work, data, "dead-no-spare")
    wait_for(lambda: last_logged_step(run) >= 25, timeout=300, poll=0.2, what="step 25")
    assert _kill_node(slurm_cluster_3nodes, "n2")
    s = wait_run_done(run, work, timeout=600)
    assert s["state"] == "finished", json.dumps(s, indent=1)[-3000:]
    first = s["attempts"][0]
    assert (first["end"], first["cause"]) == ("requeued", "node_failure")
    excluded = [e for e in events(run) if e["event"] == "node_excluded"]
    assert [e["nodes"] for e in excluded] == [["n2"]]
    started = [e for e in events(run) if e["event"] == "started" and e["node"] == 0]
    assert started[-1]["job_id"] != started[0]["job_id"] and "n2" not in started[-1]["hosts"]
    assert "n2" in slurm_cluster_3nodes.job_info(str(started[-1]["job_id"])).get("ExcNodeList", "")
    assert final_params_sha(run) == reference


# ---- issue 24: the decider is a role; health between attempts ------------------------------------


def test_head_agent_and_ranks_killed_takeover_restarts_in_place_on_the_spare(
    slurm_cluster_3nodes: SlurmCluster, work: Path, data: Path, reference: str
) -> None:
    """(a): node 0's agent, rank host and ranks SIGKILLed (the batch script lives): n2's agent takes
    the decider's role, n3 takes n1's place, one job id."""
    run = _submit(work, data, "head-killed", SPARE)
    wait_for(lambda: last_logged_step(run) >= 25, timeout=300, poll=0.2, what="step 25")
    assert _kill_node(slurm_cluster_3nodes, "n1", python_only=True)
    s = wait_run_done(run, work, timeout=600)
    assert s["state"] == "finished", json.dumps(s, indent=1)[-3000:]
    first = s["attempts"][0]
    assert (first["end"], first["cause"], first["replaced"]) == (
        "restarted in place",
        "node_failure",
        {"n1": "n3"},
    )
    decision = _decisions(run)[0]
    assert decision["node"] == 1  # decided by n2's agent: node 0's was gone
    started = [e for e in events(run) if e["event"] == "started" and e.get("in_place")]
    assert started[-1]["roster"]["training"] == ["n3", "n2"]
    finished = next(e for e in events(run) if e["event"] == "finished")
    assert finished["node"] == 2  # n3, first of the roster, decides from then on
    _one_job_no_requeue(slurm_cluster_3nodes, run)
    assert final_params_sha(run) == reference


def test_health_a_node_whose_check_fails_after_a_crash_is_replaced_by_the_spare(
    slurm_cluster_3nodes: SlurmCluster, work: Path, data: Path, reference: str
) -> None:
    """(c): a rank on n2 crashes; the node checks before the in-place attempt find n2's GPU bad
    (``testing.fail_node_check``): n3 takes its place instead of n2 being restarted."""
    run = _submit(work, data, "health", SPARE, "testing.fail_node_check={host: n2, from_in_place: 1}")
    wait_for(lambda: last_logged_step(run) >= 25, timeout=300, poll=0.2, what="step 25")
    _rank_on(run, "n2").send_signal(signal.SIGKILL)
    s = wait_run_done(run, work, timeout=600)
    assert s["state"] == "finished", json.dumps(s, indent=1)[-3000:]
    assert [(a["end"], a["cause"]) for a in s["attempts"]] == [
        ("restarted in place", "crash"),
        ("finished", None),
    ]
    replaced = [e for e in events(run) if e["event"] == "node_replaced"]
    assert [(e["nodes"], e["spare"]) for e in replaced] == [(["n2"], "n3")]
    assert "ECC" in replaced[0]["reason"] and replaced[0]["attempt"] == s["attempts"][1]["attempt"]
    checks = [
        e for e in events(run) if e["event"] == "node_preflight" and e["attempt"] == replaced[0]["attempt"]
    ]
    assert {e["node"]: e["ok"] for e in checks} == {
        0: True,
        1: False,
        2: True,
    }  # every node, between attempts
    trained = [e for e in events(run) if e["event"] == "checkpoint_saved"]
    assert trained  # (the run saved after the replacement too: it finished on n1 + n3)
    _one_job_no_requeue(slurm_cluster_3nodes, run)
    assert final_params_sha(run) == reference


@pytest.fixture(scope="module")
def reference_one_node(slurm_cluster_3nodes: SlurmCluster, work: Path, data: Path) -> str:
    hpclaunch(
        "submit",
        str(TINY),
        *tiny_overrides(work, data, "reference-1", *COMMON, "scheduler.nodes=1"),
        "--no-preflight",
        cwd=work,
    )
    s = wait_run_done(work / "runs" / "reference-1", work, timeout=600)
    assert s["state"] == "finished", json.dumps(s, indent=1)[-2000:]
    return final_params_sha(work / "runs" / "reference-1")


def test_takeover_a_hang_after_node_0_was_replaced_is_still_found_and_recovered(
    slurm_cluster_3nodes: SlurmCluster, work: Path, data: Path, reference_one_node: str
) -> None:
    """(d): one training node (n1) and two spares. n1's agent and ranks die: n2 takes the decider's
    role and n1's place. A rank on n2 then hangs: n2's agent, now the decider, leads the watchdog
    (only node 0's did before), and n3 takes n2's place."""
    run = _submit(
        work,
        data,
        "hang-after-head",
        "scheduler.nodes=1",
        "scheduler.spare_nodes=2",
        "watchdog.step_min_s=10",
        "watchdog.step_factor=1",
        "watchdog.poll_s=1",
        "testing.hang=[{rank: 1, phase: data, step: 45}]",
    )
    wait_for(lambda: last_logged_step(run) >= 25, timeout=300, poll=0.2, what="step 25")
    assert _kill_node(slurm_cluster_3nodes, "n1", python_only=True)
    s = wait_run_done(run, work, timeout=600)
    assert s["state"] == "finished", json.dumps(s, indent=1)[-3000:]
    assert [(a["end"], a["cause"], a["replaced"]) for a in s["attempts"]] == [
        ("restarted in place", "node_failure", {"n1": "n2"}),
        ("restarted in place", "hang", {"n2": "n3"}),
        ("finished", None, {}),
    ]
    hang = next(e for e in events(run) if e["event"] == "hang")
    assert (hang["culprit_node"], hang["node"]) == ("n2", 1)  # judged by n2's agent, not node 0's
    _one_job_no_requeue(slurm_cluster_3nodes, run)
    assert final_params_sha(run) == reference_one_node
