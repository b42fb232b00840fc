"""Issue 24 on the real OpenPBS, 3-node layout (pbsn1, pbsn2 training; pbsn3 a hot spare).

Finding 4: every process of the job on its mother superior pbsn1 (the job script included) is
killed at step ~25. PBS ends the job with a failed exit status; the rescue job the submission left
behind (``depend=afternotok``), or an agent left alive when it decided in time, decides the attempt
as pbsn1's node failure and continues the run without it (PBS Pro: a job naming healthy hosts), with
no person involved. (a): only the agent and ranks on pbsn1 die: restarted in place on the spare.
Every run ends bitwise equal to one that was never interrupted."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from tests.pbs.conftest import user_dir
from tests.pbs.pbslib import kill_job_on, status, submit, submitted_job, synth_data, wait_run_done
from tests.runlib import events, final_params_sha, wait_for

if TYPE_CHECKING:
    from tests.pbs.conftest import PbsServer

pytestmark = [pytest.mark.pbs, pytest.mark.slow]

COMMON = (
    "scheduler.nodes=2",
    "train.steps=60",
    "train.log_every=1",
    "testing.step_sleep_s=0.15",
    "checkpoint.every_steps=20",
    "scheduler.max_failure_retries=2",
    "scheduler.time_limit=00:10:00",
)


@pytest.fixture(scope="module")
def runs(pbs_server_3nodes: PbsServer) -> dict[str, Any]:
    server = pbs_server_3nodes
    work = user_dir(server, "head-takeover")
    data = synth_data(server, work / "data")
    # The agents left wait past PBS's kill: the rescue decides (the survivor path is SLURM's test).
    run = submit(
        server,
        work,
        data,
        "head-dies",
        *COMMON,
        "scheduler.spare_nodes=1",
        "testing.pause_before_continue_s=120",
    )
    return {"work": work, "data": data, "run": run}


def _last_step(run: Path) -> int:
    path = run / "metrics.jsonl"
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []
    return int(lines[-1]["step"]) if lines else 0


def test_head_takeover_by_the_rescue_when_every_job_process_on_the_mother_superior_dies(
    pbs_server_3nodes: PbsServer, runs: dict[str, Any]
) -> None:
    server = pbs_server_3nodes
    run: Path = runs["run"]
    first_job = submitted_job(run, events)
    (rescue,) = [e for e in events(run) if e["event"] == "rescue_submitted"]
    assert rescue["job_id"] == first_job
    wait_for(lambda: _last_step(run) >= 25, timeout=900, poll=0.2, what="step 25")
    killed = kill_job_on("pbsn1", first_job)
    assert any("mom_priv/jobs" in k for k in killed), "\n".join(killed)  # the job script too
    wait_for(
        lambda: any(e["event"] == "requeued" for e in events(run)), timeout=300, poll=0.5, what="the rescue"
    )
    s = wait_run_done(server, run, timeout=900)
    assert s["state"] == "finished", json.dumps(s, indent=1)[-3000:]
    first = s["attempts"][0]
    assert (first["end"], first["cause"]) == ("requeued", "node_failure")
    decided = [e for e in events(run) if e["event"] == "requeued"]
    assert [(e["by"], e["exclude"], e["for_job"]) for e in decided] == [("rescue", ["pbsn1"], first_job)]
    started = [e for e in events(run) if e["event"] == "started" and e["node"] == 0]
    assert started[-1]["job_id"] != first_job and "pbsn1" not in started[-1]["hosts"]
    notes = status(server, run)["rescue"]["notes"]
    assert notes and f"job {first_job}" in notes[0]

    assert final_params_sha(run) == _reference(server, runs)


def _reference(server: PbsServer, runs: dict[str, Any]) -> str:
    if "reference" not in runs:
        reference = submit(server, runs["work"], runs["data"], "reference", *COMMON)
        r = wait_run_done(server, reference, timeout=900)
        assert r["state"] == "finished", json.dumps(r, indent=1)[-2000:]
        runs["reference"] = final_params_sha(reference)
    return str(runs["reference"])


def test_head_agent_and_ranks_killed_restart_in_place_on_the_spare(
    pbs_server_3nodes: PbsServer, runs: dict[str, Any]
) -> None:
    """Issue 24 (a) on OpenPBS: the agent and ranks on the mother superior die, the job script lives:
    another agent takes the decider's role and pbsn3 takes pbsn1's place, in the same job. The
    agents are started with pbsdsh here: MPICH's mpiexec (hydra) ends every process of the launch
    when one exits abnormally, so with it the job ends and the rescue continues the run instead."""
    server = pbs_server_3nodes
    run = submit(
        server,
        runs["work"],
        runs["data"],
        "head-agent-dies",
        *COMMON,
        "scheduler.spare_nodes=1",
        "scheduler.pbs_launcher=pbsdsh",
    )
    job = submitted_job(run, events)
    wait_for(lambda: _last_step(run) >= 25, timeout=900, poll=0.2, what="step 25")
    killed = kill_job_on("pbsn1", job, python_only=True)
    assert killed and not any("mom_priv/jobs" in k for k in killed), "\n".join(killed)
    s = wait_run_done(server, run, timeout=900)
    assert s["state"] == "finished", json.dumps(s, indent=1)[-3000:]
    first = s["attempts"][0]
    assert (first["end"], first["cause"], first["replaced"]) == (
        "restarted in place",
        "node_failure",
        {"pbsn1": "pbsn3"},
    )
    assert {str(e["job_id"]) for e in events(run) if e["event"] == "started"} == {job}
    assert int(server.job(job).get("run_count", 1)) == 1
    assert final_params_sha(run) == _reference(server, runs)
