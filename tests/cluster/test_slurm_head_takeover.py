"""Issue 24, finding 4, on the real local SLURM, 3-node layout (n1, n2 training; n3 a hot spare):
every job process on the batch host n1 is killed at step ~25, the batch script included (as when
the OOM killer empties node 0 or the node dies). SLURM ends the job at once (FAILED) and no agent
decides; the rescue job the submission left behind (``afternotok``) decides the attempt as n1's
node failure and continues the run as a new job without n1, with no person involved. The run ends
bitwise equal to one that was never interrupted."""

from __future__ import annotations

import json
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
    kill_together,
    last_logged_step,
    status,
    synth_data,
    tiny_overrides,
    wait_for,
    wait_run_done,
)

if TYPE_CHECKING:
    from tests.cluster.conftest import SlurmCluster

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

TEST = "test_head_takeover_when_every_job_process_on_the_batch_host_dies"
WHO = [
    # The agents left are SIGKILLed (KillWait) before they carry their decision out: the rescue.
    "rescue",
    # They decide in time: n1's node failure, by the first live agent; the rescue does nothing.
    "agent",
]


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("head-takeover")


@pytest.fixture(scope="module")
def data(work: Path) -> Path:
    return synth_data(work / "data")


def _head_dies(cluster: SlurmCluster, work: Path, data: Path, who: str) -> tuple[Path, str, dict[str, Any]]:
    """Submitted; every process of its job on n1 SIGKILLed at step ~25; its end. The run and its
    first job."""
    slow = ("testing.pause_before_continue_s=120",) if who == "rescue" else ()
    name = f"head-dies-{who}"
    hpclaunch(
        "submit",
        str(TINY),
        *tiny_overrides(work, data, name, *COMMON, SPARE, *slow),
        "--no-preflight",
        cwd=work,
    )
    run = work / "runs" / name
    first_job = next(str(e["job_id"]) for e in events(run) if e["event"] == "submitted")
    (rescue,) = [e for e in events(run) if e["event"] == "rescue_submitted"]
    assert rescue["job_id"] == first_job
    assert cluster.job_info(rescue["rescue_job"])["JobState"] == "PENDING"  # held on the job

    wait_for(lambda: last_logged_step(run) >= 25, timeout=300, poll=0.2, what=f"{name} at step 25")
    killed = kill_together(job_processes_on(cluster, "n1", first_job))
    assert any("hpclaunch.jobs.agent" in k for k in killed) and any("slurm_script" in k for k in killed), (
        killed
    )
    assert cluster.wait_job(first_job, timeout=60) == "FAILED"  # the batch script died with them
    wait_for(
        lambda: any(e["event"] == "requeued" for e in events(run)), timeout=120, poll=0.5, what="the rescue"
    )
    return run, first_job, wait_run_done(run, work, timeout=600)


@pytest.fixture(scope="module")
def runs(
    request: pytest.FixtureRequest,
    slurm_cluster_3nodes: SlurmCluster,
    work: Path,
    data: Path,
    common_reference: Future[str],
) -> Iterator[SideBySide]:
    with SideBySide(request) as runs:
        for who in WHO:
            runs.start(
                who,
                partial(_head_dies, slurm_cluster_3nodes, work, data, who),
                for_tests=(f"{TEST}[{who}]",),
            )
        yield runs


@pytest.mark.parametrize("who", WHO)
def test_head_takeover_when_every_job_process_on_the_batch_host_dies(
    slurm_cluster_3nodes: SlurmCluster, runs: SideBySide, common_reference: Future[str], work: Path, who: str
) -> None:
    cluster = slurm_cluster_3nodes
    run, first_job, s = runs.result(who)
    assert s["state"] == "finished", json.dumps(s, indent=1)[-3000:]
    first = s["attempts"][0]
    assert (first["end"], first["cause"]) == ("requeued", "node_failure")
    decided = [e for e in events(run) if e["event"] == "requeued"]
    assert [(e["by"], e["exclude"]) for e in decided] == [(who, ["n1"])]
    excluded = [e for e in events(run) if e["event"] == "node_excluded"]
    assert [e["nodes"] for e in excluded] == [["n1"]]
    said = [e for e in events(run) if e["event"] == "rescue"]
    if who == "rescue":
        assert decided[0]["for_job"] == first_job and said == []
        # Issue 36: the agent that took the role over may have published its decision before SLURM
        # killed it (its carry-out held by the test's pause): the rescue carries that one out.
        published = run / "attempts" / first["attempt"] / "decision.json"
        if published.exists() and json.loads(published.read_text())["by"] != "rescue":
            assert "n1: its agent and ranks are gone" in (first["error"] or "")
        else:
            assert "n1: the batch host" in (first["error"] or "")
    else:
        assert "n1: its agent and ranks are gone" in (first["error"] or "")
        assert [e["action"] for e in said] == ["nothing"] and "was decided" in said[0]["reason"]
    started = [e for e in events(run) if e["event"] == "started" and e["node"] == 0]
    last_job = str(started[-1]["job_id"])
    assert last_job != first_job and "n1" not in started[-1]["hosts"]
    assert "n1" in cluster.job_info(last_job).get("ExcNodeList", "")
    # The continuation has its own rescue, withdrawn once the run finished.
    rescues = [e for e in events(run) if e["event"] == "rescue_submitted"]
    assert [e["job_id"] for e in rescues] == [first_job, last_job]
    assert cluster.wait_job(rescues[1]["rescue_job"], timeout=60) == "CANCELLED"
    notes = status(run, work)["rescue"]["notes"]  # why SLURM calls the first job FAILED
    assert notes and f"job {first_job} FAILED" in notes[0] and f"as job {last_job}" in notes[0], notes
    assert final_params_sha(run) == common_reference.result()
