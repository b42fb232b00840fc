"""Issues 17 and 24 on the real local SLURM, 3-node layout (n1, n2 training; n3 a hot spare): a
crash, a hang and a dead node are recovered inside the allocation, with no requeue and one job id
(a hang and a dead node taken by the spares: tests/cluster/test_slurm_script.py, on a user's script);
with no spare left a dead node is kept off by a new job, as before. Issue 24: node 0's agent and
ranks dying is recovered in place (another agent takes the decider's role), a node whose check
fails after a crash is replaced by the spare, and a hang after node 0 left the roster is still
found. Every run ends bitwise equal to one that was never interrupted. The runs go side by side
(``side_by_side``: each story in its own thread from the module's fixture; each test asserts on its
run's end)."""

from __future__ import annotations

import json
import signal
import subprocess
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from tests.cluster.side_by_side import COMMON, SPARE, SideBySide, kill_run_on
from tests.runlib import (
    TINY,
    attempt_ids,
    events,
    final_params_sha,
    hpclaunch,
    last_logged_step,
    rank_on_node,
    synth_data,
    tiny_overrides,
    wait_for,
    wait_run_done,
)

if TYPE_CHECKING:
    from tests.cluster.conftest import SlurmCluster

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

Ended = tuple[Path, dict[str, Any]]  # a run and its final status


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("in-place")


@pytest.fixture(scope="module")
def data(work: Path) -> Path:
    return synth_data(work / "data")


def _submit(work: Path, data: Path, name: str, *extra: str) -> Path:
    hpclaunch(
        "submit", str(TINY), *tiny_overrides(work, data, name, *COMMON, *extra), "--no-preflight", cwd=work
    )
    return work / "runs" / name


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


def _at_step_25(run: Path) -> None:
    wait_for(lambda: last_logged_step(run) >= 25, timeout=300, poll=0.2, what=f"{run.name} at step 25")


# ---- the runs, side by side (each story: submitted, its fault at its moment, its end) -------------


def _crashes(work: Path, data: Path) -> Ended:
    """(a): a rank SIGKILLed on the non-head training node, and later one on the head node."""
    run = _submit(work, data, "crashes", SPARE)
    _at_step_25(run)
    rank_on_node(run, "n2").send_signal(signal.SIGKILL)
    wait_for(
        lambda: len(attempt_ids(run)) >= 2 and last_logged_step(run) >= 45,
        timeout=300,
        poll=0.2,
        what="step 45",
    )
    rank_on_node(run, "n1").send_signal(signal.SIGKILL)
    return run, wait_run_done(run, work, timeout=600)


def _dead_node_no_spare(cluster: SlurmCluster, work: Path, data: Path) -> Ended:
    """(d): the same with no spare: SLURM continues the run as a new job without n2."""
    run = _submit(work, data, "dead-no-spare")
    _at_step_25(run)
    assert kill_run_on(cluster, run, "n2")
    return run, wait_run_done(run, work, timeout=600)


def _head_killed(cluster: SlurmCluster, work: Path, data: Path) -> Ended:
    """(a): node 0's agent, rank host and ranks SIGKILLed (the batch script lives): n2's agent takes
    the decider's role, n3 takes n1's place, one job id."""
    run = _submit(work, data, "head-killed", SPARE)
    _at_step_25(run)
    assert kill_run_on(cluster, run, "n1", python_only=True)
    return run, wait_run_done(run, work, timeout=600)


def _health(work: Path, data: Path) -> Ended:
    """(c): a rank on n2 crashes; the node checks before the in-place attempt find n2's GPU bad
    (``testing.fail_node_check``): n3 takes its place instead of n2 being restarted."""
    run = _submit(work, data, "health", SPARE, "testing.fail_node_check={host: n2, from_in_place: 1}")
    _at_step_25(run)
    rank_on_node(run, "n2").send_signal(signal.SIGKILL)
    return run, wait_run_done(run, work, timeout=600)


def _hang_after_head(cluster: SlurmCluster, work: Path, data: Path) -> Ended:
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
    _at_step_25(run)
    assert kill_run_on(cluster, run, "n1", python_only=True)
    return run, wait_run_done(run, work, timeout=600)


def _reference_one_node(work: Path, data: Path) -> str:
    run = _submit(work, data, "reference-1", "scheduler.nodes=1", "testing.step_sleep_s=0")
    s = wait_run_done(run, work, timeout=600)
    assert s["state"] == "finished", json.dumps(s, indent=1)[-2000:]
    return final_params_sha(run)


@pytest.fixture(scope="module")
def runs(
    request: pytest.FixtureRequest,
    slurm_cluster_3nodes: SlurmCluster,
    work: Path,
    data: Path,
    common_reference: Future[str],
) -> Iterator[SideBySide]:
    cluster = slurm_cluster_3nodes
    hang = "test_takeover_a_hang_after_node_0_was_replaced_is_still_found_and_recovered"
    with SideBySide(request) as runs:
        runs.start(
            "crashes",
            lambda: _crashes(work, data),
            for_tests=("test_a_crash_on_a_worker_node_then_on_the_head_restarts_in_place",),
        )
        runs.start(
            "dead-no-spare",
            lambda: _dead_node_no_spare(cluster, work, data),
            for_tests=("test_a_dead_node_without_a_spare_is_kept_off_by_a_new_job",),
        )
        runs.start(
            "head-killed",
            lambda: _head_killed(cluster, work, data),
            for_tests=("test_head_agent_and_ranks_killed_takeover_restarts_in_place_on_the_spare",),
        )
        runs.start(
            "health",
            lambda: _health(work, data),
            for_tests=("test_health_a_node_whose_check_fails_after_a_crash_is_replaced_by_the_spare",),
        )
        runs.start("hang-after-head", lambda: _hang_after_head(cluster, work, data), for_tests=(hang,))
        runs.start("reference-1", lambda: _reference_one_node(work, data), for_tests=(hang,))
        yield runs


# ---- the tests: each takes its run's end --------------------------------------------------------


def test_a_crash_on_a_worker_node_then_on_the_head_restarts_in_place(
    slurm_cluster_3nodes: SlurmCluster, runs: SideBySide, common_reference: Future[str]
) -> None:
    run, s = runs.result("crashes")
    assert s["state"] == "finished", json.dumps(s, indent=1)[-3000:]
    assert [(a["end"], a["cause"]) for a in s["attempts"]] == [
        ("restarted in place", "crash"),
        ("restarted in place", "crash"),
        ("finished", None),
    ]
    assert [(d["in_place"], d["counts_as"]) for d in _decisions(run)] == [(True, "crash")] * 2
    _one_job_no_requeue(slurm_cluster_3nodes, run)
    assert final_params_sha(run) == common_reference.result()


def test_a_dead_node_without_a_spare_is_kept_off_by_a_new_job(
    slurm_cluster_3nodes: SlurmCluster, runs: SideBySide, common_reference: Future[str]
) -> None:
    run, s = runs.result("dead-no-spare")
    assert s["state"] == "finished", json.dumps(s, indent=1)[-3000:]
    first = s["attempts"][0]
    assert (first["end"], first["cause"]) == ("requeued", "node_failure")
    excluded = [e for e in events(run) if e["event"] == "node_excluded"]
    assert [e["nodes"] for e in excluded] == [["n2"]]
    started = [e for e in events(run) if e["event"] == "started" and e["node"] == 0]
    assert started[-1]["job_id"] != started[0]["job_id"] and "n2" not in started[-1]["hosts"]
    assert "n2" in slurm_cluster_3nodes.job_info(str(started[-1]["job_id"])).get("ExcNodeList", "")
    assert final_params_sha(run) == common_reference.result()


# ---- issue 24: the decider is a role; health between attempts ------------------------------------


def test_head_agent_and_ranks_killed_takeover_restarts_in_place_on_the_spare(
    slurm_cluster_3nodes: SlurmCluster, runs: SideBySide, common_reference: Future[str]
) -> None:
    run, s = runs.result("head-killed")
    assert s["state"] == "finished", json.dumps(s, indent=1)[-3000:]
    first = s["attempts"][0]
    assert (first["end"], first["cause"], first["replaced"]) == (
        "restarted in place",
        "node_failure",
        {"n1": "n3"},
    )
    decision = _decisions(run)[0]
    # decided by n2's agent (node 0's was gone); recorded by it, or by n3 when n3, first of the new
    # roster, took the role between n2's publication and its record (``Decider.record_followed``)
    assert decision["node"] == 1 or (decision["node"] == 2 and decision["note"] == "decided by n2 (deposed)")
    started = [e for e in events(run) if e["event"] == "started" and e.get("in_place")]
    assert started[-1]["roster"]["training"] == ["n3", "n2"]
    finished = next(e for e in events(run) if e["event"] == "finished")
    assert finished["node"] == 2  # n3, first of the roster, decides from then on
    _one_job_no_requeue(slurm_cluster_3nodes, run)
    assert final_params_sha(run) == common_reference.result()


def test_health_a_node_whose_check_fails_after_a_crash_is_replaced_by_the_spare(
    slurm_cluster_3nodes: SlurmCluster, runs: SideBySide, common_reference: Future[str]
) -> None:
    run, s = runs.result("health")
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
    assert final_params_sha(run) == common_reference.result()


def test_takeover_a_hang_after_node_0_was_replaced_is_still_found_and_recovered(
    slurm_cluster_3nodes: SlurmCluster, runs: SideBySide
) -> None:
    run, s = runs.result("hang-after-head")
    assert s["state"] == "finished", json.dumps(s, indent=1)[-3000:]
    assert [(a["end"], a["cause"], a["replaced"]) for a in s["attempts"]] == [
        ("restarted in place", "node_failure", {"n1": "n2"}),
        ("restarted in place", "hang", {"n2": "n3"}),
        ("finished", None, {}),
    ]
    hang = next(e for e in events(run) if e["event"] == "hang")
    assert (hang["culprit_node"], hang["node"]) == ("n2", 1)  # judged by n2's agent, not node 0's
    _one_job_no_requeue(slurm_cluster_3nodes, run)
    assert final_params_sha(run) == runs.result("reference-1")
