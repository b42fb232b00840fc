"""Issue 17 on the real OpenPBS, 3-node layout (pbsn1, pbsn2 training; pbsn3 a hot spare): a crash
on a worker node is recovered inside the job, with no continuation job (one job id, PBS's run_count
1), bitwise equal to a run that was never interrupted. A hang recovered by a spare on PBS, and a
node's death after it, are tests/pbs/test_pbs_script_spares.py's run (the agent's path is the same
for the built-in trainer and a script; the trainer's own hangs are tests/cluster/test_slurm_hangs.py)."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil
import pytest
from tests.pbs.conftest import user_dir
from tests.pbs.pbslib import submit, synth_data, wait_run_done
from tests.runlib import events, final_params_sha, wait_for

if TYPE_CHECKING:
    from tests.pbs.conftest import PbsServer

pytestmark = [pytest.mark.pbs, pytest.mark.slow]

COMMON = (
    "scheduler.nodes=2",  # tiny: 2 ranks per node, world size 4
    "train.steps=60",
    "train.log_every=1",
    "testing.step_sleep_s=0.15",
    "checkpoint.every_steps=20",
    "scheduler.max_failure_retries=2",
    "scheduler.time_limit=00:10:00",
)
SPARE = "scheduler.spare_nodes=1"


@pytest.fixture(scope="module")
def runs(pbs_server_3nodes: PbsServer) -> dict[str, Any]:
    """The reference and the crashed run, submitted together (2 and 3 nodes: the scheduler runs them
    one after the other)."""
    server = pbs_server_3nodes
    work = user_dir(server, "inplace")
    data = synth_data(server, work / "data")
    return {
        "work": work,
        "reference": submit(server, work, data, "reference", *COMMON),
        "crash": submit(server, work, data, "crash", *COMMON, SPARE),
    }


def _reference(server: PbsServer, runs: dict[str, Any]) -> str:
    s = wait_run_done(server, runs["reference"], timeout=900)
    assert s["state"] == "finished", json.dumps(s, indent=1)[-2000:]
    return final_params_sha(runs["reference"])


def _last_step(run: Path) -> int:
    path = run / "metrics.jsonl"
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []
    return int(lines[-1]["step"]) if lines else 0


def _one_job(server: PbsServer, run: Path) -> None:
    jobs = {str(e["job_id"]) for e in events(run) if e["event"] == "started"}
    assert len(jobs) == 1, jobs
    assert int(server.job(jobs.pop()).get("run_count", 1)) == 1  # PBS never ran it again


def test_a_crash_on_a_worker_node_restarts_in_place(
    pbs_server_3nodes: PbsServer, runs: dict[str, Any]
) -> None:
    """(a) on PBS: a rank SIGKILLed on the non-head training node."""
    run: Path = runs["crash"]
    wait_for(lambda: _last_step(run) >= 25, timeout=900, poll=0.2, what="step 25")
    attempt = [e["attempt"] for e in events(run) if e["event"] == "started"][-1]
    victim = None
    from hpclaunch.rundir import RunPaths
    from hpclaunch.rundir.progress_files import read_progress

    for _, record in sorted(read_progress(RunPaths(run), attempt).items()):
        if record.node == "pbsn2" and record.pid:
            victim = record.pid
    assert victim is not None
    psutil.Process(victim).send_signal(signal.SIGKILL)
    s = wait_run_done(pbs_server_3nodes, run, timeout=900)
    assert s["state"] == "finished", json.dumps(s, indent=1)[-3000:]
    assert [(a["end"], a["cause"]) for a in s["attempts"]] == [
        ("restarted in place", "crash"),
        ("finished", None),
    ]
    _one_job(pbs_server_3nodes, run)
    assert final_params_sha(run) == _reference(pbs_server_3nodes, runs)
