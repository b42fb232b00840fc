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
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from tests import byo_faults
from tests.byo_faults import DDP, FAULTY_STEPS, SMALL
from tests.pbs.conftest import user_dir
from tests.pbs.pbslib import kill_job_on, submitted_job, wait_run_done
from tests.runlib import events, final_params_sha

if TYPE_CHECKING:
    from tests.pbs.conftest import PbsServer

pytestmark = [pytest.mark.pbs, pytest.mark.slow]

FAULTY = ("scheduler.kind=pbs", "scheduler.pbs_launcher=pbsdsh", *byo_faults.FAULTY)


def _sets(name: str, *overrides: str) -> list[str]:
    return [a for s in (f"name={name}", "scheduler.procs_per_node=2", *overrides) for a in ("--set", s)]


def _script_args() -> list[str]:
    return ["--", *SMALL, "--steps", str(FAULTY_STEPS)]


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
    spare = byo_faults.crash_then_hang(run, "pbsn1")
    assert kill_job_on(spare, job, python_only=True)
    s = wait_run_done(server, run, timeout=600)
    assert s["state"] == "finished", json.dumps(s, indent=1)[-3000:]
    byo_faults.assert_recovered(s, run, "pbsn1", spare)
    assert {str(e["job_id"]) for e in events(run) if e["event"] == "started"} == {job}  # one PBS job
    assert 0 < s["time"]["goodput"] <= 1
    assert final_params_sha(run) == _reference(server, runs["work"])
