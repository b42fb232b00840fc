"""Whole runs on the real OpenPBS (one node): walltime, qrerun, qdel, a sweep as a PBS Pro array.

The runs are submitted together when the module starts and overlap (PBS runs them side by side),
so the module costs about as long as its longest run. Each test then acts on its run (qdel,
qrerun) and checks the ledger, `status --json`, PBS's own record (`qstat -x -F json`) and the
final parameters against an uninterrupted `hpclaunch train` of the same config.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from tests.pbs.conftest import user_dir
from tests.pbs.pbslib import (
    finish_train,
    start_train,
    status,
    submit,
    submitted_job,
    synth_data,
    wait_run_done,
)
from tests.runlib import events, final_params_sha, outlasting, wait_for

if TYPE_CHECKING:
    from tests.pbs.conftest import PbsServer

pytestmark = [pytest.mark.pbs, pytest.mark.slow]

# Long enough that a 60 s walltime cannot hold it on any machine (its sleep alone outlasts the
# walltime less the margin); the margin leaves the agent room to decide before the walltime.
LONG = (
    *outlasting(100, 0.6, time_limit_s=60, stop_margin_s=8),  # few steps, long sleeps
    "train.log_every=10",
    "checkpoint.every_steps=50",
)
WALLTIME = "scheduler.time_limit=60s"
ROOMY = "scheduler.time_limit=00:05:00"
# The sweep: its long point sleeps 120 s in steps, more than a 120 s walltime can hold even with no
# start-up at all, so it is always continued; its short point (4 s) always finishes in its sub-job,
# even when the start-up takes 50 s on a loaded 2-core machine (a 60 s walltime failed there).
SWEEP_WALLTIME = "scheduler.time_limit=120s"
SWEEP = (
    "testing.step_sleep_s=0.6",
    "train.log_every=20",
    "checkpoint.every_steps=50",
    "launch.stop_margin_s=8",
)


@pytest.fixture(scope="module")
def runs(pbs_server: PbsServer) -> dict[str, Any]:
    """Data, the reference run (in the background) and every run of this module, submitted at once."""
    work = user_dir(pbs_server, "runs")
    data = synth_data(pbs_server, work / "data")
    reference = start_train(
        pbs_server, work, data, "reference", *LONG[:1], "testing.step_sleep_s=0", *LONG[2:]
    )
    submitted = {
        "cancel": submit(pbs_server, work, data, "cancel", ROOMY, *LONG),
        "rerun": submit(pbs_server, work, data, "rerun", ROOMY, *LONG),
        "walltime": submit(pbs_server, work, data, "walltime", WALLTIME, *LONG),
        "sweep": submit(
            pbs_server,
            work,
            data,
            "sweep",
            SWEEP_WALLTIME,
            *SWEEP,
            "train.warmup_steps=5",
            sweep="train.steps=6,200",
        ),
    }
    return {"work": work, "reference": reference, "reference_sha": None, **submitted}


def reference_sha(runs: dict[str, Any]) -> str:
    if runs["reference_sha"] is None:
        finish_train(runs["reference"])
        runs["reference_sha"] = final_params_sha(runs["work"] / "runs" / "reference")
    return str(runs["reference_sha"])


def attempt_ends(s: dict[str, Any]) -> list[tuple[str, str | None]]:
    return [(a["end"], a["cause"]) for a in s["attempts"]]


def test_qdel_is_cancelled_never_continued(pbs_server: PbsServer, runs: dict[str, Any]) -> None:
    run: Path = runs["cancel"]
    job = submitted_job(run, events)
    wait_for(lambda: any(e["event"] == "resumed" for e in events(run)), timeout=120, what="training")
    pbs_server.check("qdel", job)
    s = wait_run_done(pbs_server, run, timeout=90)
    assert s["state"] == "cancelled", json.dumps(s, indent=1)[-3000:]
    assert attempt_ends(s) == [("cancelled", "cancelled")]
    story = events(run)
    assert not any(e["event"] in ("requeued", "failed") for e in story)
    assert pbs_server.job(job)["substate"] == 91  # PBS: terminated by qdel
    assert s["scheduler"]["state"] == "cancelled" and s["scheduler"]["raw"] == "F/91"


def test_qrerun_is_a_preemption_saved_within_kill_delay(pbs_server: PbsServer, runs: dict[str, Any]) -> None:
    run: Path = runs["rerun"]
    job = submitted_job(run, events)
    wait_for(
        lambda: any(e["event"] == "checkpoint_saved" for e in events(run)),
        timeout=150,
        what="first checkpoint",
    )
    pbs_server.check("qrerun", job, as_user=False)  # a manager's command (root here)
    s = wait_run_done(pbs_server, run, timeout=240)
    assert s["state"] == "finished", json.dumps(s, indent=1)[-3000:]
    assert attempt_ends(s) == [("requeued", "preemption"), ("finished", None)]
    # PBS itself ran the same job again: no continuation job, and the attempts count its runs
    assert [a["job_id"] for a in s["attempts"]] == [job, job]
    assert [a["restart_count"] for a in s["attempts"]] == [0, 1]
    assert pbs_server.job(job)["run_count"] == 2
    story = events(run)
    requeued = [e for e in story if e["event"] == "requeued"]
    assert [(e["cause"], e["by"], e["job_id"]) for e in requeued] == [("preemption", "scheduler", job)]
    stopped = [e for e in story if e["event"] == "stopped"]
    assert stopped and stopped[0]["cause"] == "preemption"  # every rank saved before kill_delay ran out
    resumed = [e["step"] for e in story if e["event"] == "resumed"]
    assert resumed[1] == stopped[0]["step"]
    assert s["step_counts"]["repeated_steps"] == 0 and s["step_counts"]["lost_steps"] == 0
    assert final_params_sha(run) == reference_sha(runs)


def test_walltime_stops_saves_and_continues_bitwise_equal(
    pbs_server: PbsServer, runs: dict[str, Any]
) -> None:
    run: Path = runs["walltime"]
    s = wait_run_done(pbs_server, run, timeout=300)
    assert s["state"] == "finished", json.dumps(s, indent=1)[-3000:]
    ends = attempt_ends(s)
    assert (
        len(ends) >= 2 and all(e == ("requeued", "timeout") for e in ends[:-1]) and ends[-1][0] == "finished"
    )
    jobs = [a["job_id"] for a in s["attempts"]]
    assert len(set(jobs)) == len(jobs)  # every continuation is its own PBS job ...
    for before, after in itertools.pairwise(jobs):
        # ... submitted to wait for the one before it (PBS drops "depend" once it is released)
        assert pbs_server.job(after)["Submit_arguments"].startswith(f"-W depend=afterany:{before} ")
    story = events(run)
    ends_at = {e["attempt"]: e["end_time"] for e in story if e["event"] == "started" and e["node"] == 0}
    stops = [e for e in story if e["event"] == "stopped"]
    assert [e["cause"] for e in stops] == ["timeout"] * (len(ends) - 1)
    # every stop was the deadline's, saved before PBS's walltime SIGTERM
    assert all(e["ts"] < ends_at[e["attempt"]] for e in stops), (stops, ends_at)
    first = pbs_server.job(jobs[0])
    # PBS's view: the job ended by itself (92/0), or, on a machine too busy for the agent to decide
    # within the margin, at the walltime (93/-29) after the save and the continuation
    assert (first["substate"], first["Exit_status"]) in ((92, 0), (93, -29)), first
    assert s["step_counts"]["repeated_steps"] == 0 and s["step_counts"]["lost_steps"] == 0
    assert final_params_sha(run) == reference_sha(runs)


def test_sweep_is_one_pbs_pro_array_and_one_point_continues_alone(
    pbs_server: PbsServer, runs: dict[str, Any]
) -> None:
    root: Path = runs["sweep"]
    sweep = json.loads((root / "sweep.json").read_text())
    array = sweep["job_id"]
    assert array.endswith("[]." + pbs_server.head)  # one PBS Pro array (-J 0-1)
    points = [Path(p["run_dir"]) for p in sweep["points"]]
    assert len(points) == 2 and len({p.parent for p in points}) == 1
    # Waits on the runs' own ends (no margin to hit): up to four 120 s attempts under load.
    short, long = (wait_run_done(pbs_server, p, timeout=900) for p in points)
    assert short["state"] == long["state"] == "finished", (short, long)
    # point 0 (6 steps) finished in its sub-job; point 1 (200 steps) was continued alone
    sub = [array.replace("[]", f"[{i}]") for i in range(2)]
    assert [a["job_id"] for a in short["attempts"]] == [sub[0]]
    assert long["attempts"][0]["job_id"] == sub[1] and attempt_ends(long)[0] == ("requeued", "timeout")
    assert len(long["attempts"]) >= 2 and not any(
        a["job_id"].startswith(array[:-1]) for a in long["attempts"][1:]
    )
    assert [pbs_server.job(j)["substate"] for j in sub] == [92, 92]
    # status per index: the sweep table names every point with its own state
    table = json.loads(pbs_server.hpclaunch("status", str(root), "--json", cwd=root.parent).stdout)
    assert [(Path(p["run"]).name, p["state"]) for p in table["points"]] == [
        (points[0].name, "finished"),
        (points[1].name, "finished"),
    ]
    assert status(pbs_server, points[0])["scheduler"]["raw"] == "F/92"
