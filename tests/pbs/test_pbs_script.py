"""Bring your own trainer on the real OpenPBS (one node): the example GPT script
(examples/byo/gpt_ddp.py, DDP over gloo, a DataLoader with a worker) submitted with ``--script``.

Two runs side by side, each bitwise against the same script trained uninterrupted with
``hpclaunch train --script`` as the job user:

- with a 60 s walltime: every rank stops after the same step with a save before PBS's walltime,
  each continuation is its own PBS job (``depend=afterany``), and the run finishes;
- with its last rank dying after step 12 (``testing.crash_at_step``): the node agent restarts the
  attempt in place inside the same PBS job and the script's attach restores the newest snapshot
  from the node's memory.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from tests.byo_faults import DDP, SMALL
from tests.pbs.conftest import user_dir
from tests.pbs.pbslib import wait_run_done
from tests.runlib import events, final_params_sha, outlasting

if TYPE_CHECKING:
    from tests.pbs.conftest import PbsServer

pytestmark = [pytest.mark.pbs, pytest.mark.slow]

STEPS = 110
# Its sleep alone outlasts the walltime less the margin: continued at least once on any machine.
WALLTIME = ("scheduler.time_limit=60s", *outlasting(STEPS, 0.6, time_limit_s=60, stop_margin_s=8)[1:])
CRASHED = (
    "scheduler.time_limit=00:08:00", "testing.step_sleep_s=0.2", "testing.crash_at_step=12",
    "checkpoint.memory.every_steps=2", "checkpoint.every_steps=50", "scheduler.max_failure_retries=1",
)  # fmt: skip


def _sets(name: str, *overrides: str) -> list[str]:
    return [a for s in (f"name={name}", "scheduler.procs_per_node=2", *overrides) for a in ("--set", s)]


def _script_args(steps: int) -> list[str]:
    return ["--", *SMALL, "--steps", str(steps)]


@pytest.fixture(scope="module")
def runs(pbs_server: PbsServer) -> dict[str, Any]:
    """Both runs submitted at once; the reference trained alongside, as the job user."""
    work = user_dir(pbs_server, "script")
    submitted = {}
    for name, overrides in (("walltime", WALLTIME), ("crashed", CRASHED)):
        pbs_server.hpclaunch(
            "submit", "--script", str(DDP), *_sets(name, "scheduler.kind=pbs", *overrides), "--no-preflight",
            *_script_args(STEPS), cwd=work,
        )  # fmt: skip
        submitted[name] = work / "runs" / name
    reference = subprocess.Popen(
        [
            "runuser", "-u", pbs_server.user, "--", "/usr/bin/env", "-i",
            *(f"{k}={v}" for k, v in pbs_server.env.items()),
            pbs_server.python, "-m", "hpclaunch", "train", "--script", str(DDP), *_sets("reference"),
            *_script_args(STEPS),
        ],
        cwd=work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    return {"work": work, "reference": reference, "reference_sha": None, **submitted}


def _reference_sha(runs: dict[str, Any]) -> str:
    if runs["reference_sha"] is None:
        out, _ = runs["reference"].communicate(timeout=900)
        assert runs["reference"].returncode == 0, out[-3000:]
        runs["reference_sha"] = final_params_sha(runs["work"] / "runs" / "reference")
    return str(runs["reference_sha"])


def test_a_script_at_the_walltime_stops_saves_and_continues_bitwise(
    pbs_server: PbsServer, runs: dict[str, Any]
) -> None:
    run: Path = runs["walltime"]
    s = wait_run_done(pbs_server, run, timeout=600)
    assert s["state"] == "finished", json.dumps(s, indent=1)[-3000:]
    ends = [(a["end"], a["cause"]) for a in s["attempts"]]
    assert len(ends) >= 2 and all(e == ("requeued", "timeout") for e in ends[:-1]), ends
    assert ends[-1][0] == "finished", ends
    jobs = [a["job_id"] for a in s["attempts"]]
    assert len(set(jobs)) == len(jobs)  # each continuation its own PBS job
    stops = [e for e in events(run) if e["event"] == "stopped"]
    assert [e["cause"] for e in stops] == ["timeout"] * (len(ends) - 1)
    resumed = [e["step"] for e in events(run) if e["event"] == "resumed"]
    assert resumed[1:] == [e["step"] for e in stops]  # each continuation starts where the stop saved
    assert (s["step"], s["steps"]) == (STEPS, STEPS)
    assert s["step_counts"]["repeated_steps"] == 0 and s["step_counts"]["lost_steps"] == 0
    assert final_params_sha(run) == _reference_sha(runs)


def test_a_scripts_crashed_rank_restarts_in_place_from_memory_in_the_same_pbs_job_bitwise(
    pbs_server: PbsServer, runs: dict[str, Any]
) -> None:
    run: Path = runs["crashed"]
    s = wait_run_done(pbs_server, run, timeout=600)
    assert s["state"] == "finished", json.dumps(s, indent=1)[-3000:]
    first, second = s["attempts"][:2]
    assert (first["end"], first["cause"]) == ("restarted in place", "crash") and second["in_place"], first
    assert first["job_id"] == second["job_id"]  # inside the allocation: no new PBS job
    assert second["resumed_from"] == "memory" and 8 <= second["resumed_step"] <= 12, second
    assert final_params_sha(run) == _reference_sha(runs)
