"""Bring your own trainer on the real OpenPBS, 3-node layout (pbsn1 training; pbsn2, pbsn3 hot
spares): the example GPT script (examples/byo/gpt_ddp.py, DDP over gloo, a DataLoader with a
worker) submitted with ``--script``, its faults recovered inside the one PBS job:

- a rank killed is restarted in place from the memory tier's snapshots;
- a rank that hangs is found by the watchdog and its node replaced by a spare;
- that node then dies (every process of the job on it: its agent and all it started) and the other
  spare takes its place.

Bitwise against the same script trained uninterrupted with ``hpclaunch train --script`` as the job
user; its status says step/total, goodput and the tier each attempt resumed from. The agents are
started with pbsdsh: MPICH's mpiexec ends every process of its launch when one dies, and the job
with them (the rescue's path, tests/pbs/test_pbs_head_takeover.py)."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil
import pytest
from tests.pbs.conftest import user_dir
from tests.pbs.pbslib import kill_job_on, submitted_job, wait_run_done
from tests.runlib import ROOT, attempt_ids, events, final_params_sha, last_logged_step, wait_for

if TYPE_CHECKING:
    from tests.pbs.conftest import PbsServer

pytestmark = [pytest.mark.pbs, pytest.mark.slow]

DDP = ROOT / "examples" / "byo" / "gpt_ddp.py"
SMALL = ["--batch", "4", "--block", "16", "--layers", "1", "--d-model", "32", "--workers", "1"]
STEPS = 70
FAULTY = (
    "scheduler.kind=pbs", "scheduler.nodes=1", "scheduler.spare_nodes=2", "scheduler.pbs_launcher=pbsdsh",
    "scheduler.time_limit=00:10:00", "testing.step_sleep_s=0.3", "checkpoint.every_steps=10",
    "checkpoint.memory.every_steps=2", "watchdog.step_min_s=20", "watchdog.step_factor=1",
    "watchdog.poll_s=1", "testing.hang=[{rank: 1, phase: data, step: 30}]", "scheduler.max_failure_retries=2",
)  # fmt: skip


def _sets(name: str, *overrides: str) -> list[str]:
    return [a for s in (f"name={name}", "scheduler.procs_per_node=2", *overrides) for a in ("--set", s)]


def _script_args() -> list[str]:
    return ["--", *SMALL, "--steps", str(STEPS)]


@pytest.fixture(scope="module")
def runs(pbs_server_3nodes: PbsServer) -> dict[str, Any]:
    """The faulty run submitted; the reference trains once the run has ended (beside the run it
    would slow it, and its watchdog's windows are tight)."""
    server = pbs_server_3nodes
    work = user_dir(server, "script-spares")
    server.hpclaunch(
        "submit", "--script", str(DDP), *_sets("faulty", *FAULTY), "--no-preflight", *_script_args(), cwd=work
    )
    return {"work": work, "faulty": work / "runs" / "faulty"}


def _rank_on(run: Path, node: str) -> psutil.Process:
    def found() -> psutil.Process | None:
        from hpclaunch.rundir import RunPaths
        from hpclaunch.rundir.progress_files import read_progress

        for _, record in sorted(read_progress(RunPaths(run), attempt_ids(run)[-1]).items()):
            if record.node == node and record.pid:
                return psutil.Process(record.pid)
        return None

    return wait_for(found, timeout=120, poll=0.2, what=f"a rank of {run.name} on {node}")


def _training_node(run: Path) -> str:
    started = [e for e in events(run) if e["event"] == "started" and e.get("node") == 0]
    return str(started[-1]["roster"]["training"][0])


def _reference(server: PbsServer, work: Path) -> str:
    """The script trained uninterrupted on this machine, as the job user, at the same world size."""
    done = subprocess.run(
        [
            "runuser", "-u", server.user, "--", "/usr/bin/env", "-i",
            *(f"{k}={v}" for k, v in server.env.items()),
            server.python, "-m", "hpclaunch", "train", "--script", str(DDP), *_sets("reference"), *_script_args(),
        ],
        cwd=work, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    return final_params_sha(work / "runs" / "reference")


@pytest.mark.timeout(1200)
def test_a_script_crashed_hung_and_killed_on_pbs_restarts_in_place_and_on_the_spares_bitwise(
    pbs_server_3nodes: PbsServer, runs: dict[str, Any]
) -> None:
    server, run = pbs_server_3nodes, runs["faulty"]
    job = submitted_job(run, events)
    wait_for(
        lambda: any(e["event"] == "snapshot_saved" and e.get("step", 0) >= 6 for e in events(run)),
        timeout=600,
        poll=0.2,
        what="a snapshot at step 6 or later",
    )
    _rank_on(run, "pbsn1").send_signal(signal.SIGKILL)
    wait_for(
        lambda: len(attempt_ids(run)) >= 3 and last_logged_step(run) >= 45,
        timeout=600,
        poll=0.2,
        what="step 45 on a spare",
    )
    node = _training_node(run)
    assert node != "pbsn1" and kill_job_on(node, job, python_only=True)
    s = wait_run_done(server, run, timeout=600)
    assert s["state"] == "finished", json.dumps(s, indent=1)[-3000:]
    ends = [(a["end"], a["cause"]) for a in s["attempts"]]
    assert ends == [
        ("restarted in place", "crash"), ("restarted in place", "hang"),
        ("restarted in place", "node_failure"), ("finished", None),
    ], ends  # fmt: skip
    assert s["attempts"][1]["resumed_from"] == "memory", s["attempts"][1]
    hang = next(e for e in events(run) if e["event"] == "hang")
    assert hang["ranks"] == [1] and hang["culprit_node"] == "pbsn1", hang
    replaced = [e["nodes"] for e in events(run) if e["event"] == "node_replaced"]
    assert replaced == [["pbsn1"], [node]], replaced
    assert {str(e["job_id"]) for e in events(run) if e["event"] == "started"} == {job}  # one PBS job
    assert (s["step"], s["steps"]) == (STEPS, STEPS) and 0 < s["time"]["goodput"] <= 1
    assert s["step_counts"]["lost_steps"] == 0  # (a fault repeats the steps since the copy it resumed)
    assert final_params_sha(run) == _reference(server, runs["work"])
