"""The rescue job: a small job left behind every job of a run, that runs only if that job ends in a
failed state, so that a job the scheduler ended before any agent could decide still continues.

Why: when every job process on the batch host dies (the batch script included: the OOM killer
emptying node 0, the node's death), SLURM ends the job at once (FAILED 0:9). The agents of the
other nodes are killed with it, nobody decides the attempt, and nothing would continue the run.
The scheduler itself then starts the rescue (``python -m hpclaunch.jobs.rescue RUN JOB``, tiny:
one task, five minutes, the run's account, ``scheduler.rescue``'s partition, QOS and GPUs: the
run's partition and QOS, and one GPU where that partition is the run's GPU one), which decides the attempt as the node
failure it was and submits the continuation without that node. A job that ends well (an agent
decided, and exited 0) never starts it: SLURM drops it (``--kill-on-invalid-dep=yes``), PBS
deletes a job whose ``afternotok`` can no longer be satisfied. A requeue (``scontrol requeue``, a
preemption) puts the same job back to PENDING, which does not satisfy ``afternotok`` either
(measured on the local Slurm 22.05); the rescue stays for the job's next run.

Each scheduler renders its rescue script (``render_rescue``, the exact text handed over; the job
id it watches goes on the command line, as ``--hold`` does) and submits it (``submit_rescue``).
This module holds what they share, records each submission in the ledger (``rescue_submitted``)
and withdraws the rescue jobs that still wait once the run has ended for good. With
``scheduler.rescue.enabled: false`` none is left (a held job counts against the user's job limits).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..errors import HpclaunchError
from ..rundir import (
    RESCUE_CANCELLED,
    RESCUE_NOT_SUBMITTED,
    RESCUE_SUBMITTED,
    RUN_ENDS,
    SUBMITTED,
    SUBMITTING,
    Event,
    Ledger,
    read_events,
)
from ..rundir.events import RescueCancelled, RescueSubmitted, Submitted, Submitting
from ..templates.exports import script_header
from ..templates.shell import Raw, join

if TYPE_CHECKING:
    from ..rundir import JobPlan, RunPaths

RESCUE_MODULE = "hpclaunch.jobs.rescue"
RESCUE_MINUTES = 5  # reading a ledger and one sbatch/qsub; the smallest limit both schedulers know
# The running rescue's own job id (so that it never withdraws itself).
SELF_VARS = ("SLURM_JOB_ID", "PBS_JOBID")


def rescue_argv(plan: JobPlan) -> list[str]:
    """What the rescue runs, but the watched job's id (``python -m hpclaunch.jobs.rescue RUN``)."""
    return [plan.python, "-u", "-m", RESCUE_MODULE, plan.run_dir]


def rescue_header(plan: JobPlan, submitted_as: str) -> list[str]:
    """The script's first lines: what wrote it, what it is, and how it is handed over."""
    return [
        "#!/bin/bash",
        script_header(plan),
        "# hpclaunch rescue: runs only if the job it watches ends in a failed state with its attempt",
        "# undecided (its batch host died); submitted as",
        f"#   {submitted_as}",
    ]


def rescue_body(plan: JobPlan, job_ref: str) -> list[str]:
    """The script's body: the run's setup lines (its Python may need them), then the rescue on the
    job ``job_ref`` names (shell syntax: ``"$1"``, ``"$VAR"``)."""
    return [*plan.setup, f"exec {join(rescue_argv(plan))} {Raw(job_ref)}"]


def leave_rescue(scheduler: Any, plan: JobPlan, paths: RunPaths, job_id: str, *, role: str) -> str | None:
    """Submit the rescue of ``job_id`` and record it; the rescue's job id, or None where the
    scheduler has none (local: its controller outlives the job) or refused it (recorded, never
    raised: a job that runs without a rescue is still a job that runs)."""
    submit = getattr(scheduler, "submit_rescue", None)
    if submit is None or plan.sweep or not plan.rescue.enabled:
        return None
    ledger = Ledger(paths, role=role)
    try:
        rescue = submit(plan, paths, job_id)
    except HpclaunchError as e:
        ledger.append(RESCUE_NOT_SUBMITTED, job_id=job_id, error=e.one_line())
        return None
    if rescue is not None:
        ledger.append(RESCUE_SUBMITTED, job_id=job_id, rescue_job=rescue)
    return rescue


def waiting_rescues(events: Sequence[Event], *, own: str | None = None) -> list[str]:
    """Rescue jobs recorded since the run's latest submission (but ``own``), not yet withdrawn."""
    found: list[str] = []
    for e in events:
        if isinstance(e, (Submitting, Submitted)) and not e.resume:
            found.clear()
        elif isinstance(e, RescueSubmitted) and e.rescue_job:
            found.append(e.rescue_job)
        elif isinstance(e, RescueCancelled):
            gone = set(e.rescue_jobs)
            found = [j for j in found if j not in gone]
    return [j for j in dict.fromkeys(found) if j != own]


def run_has_ended(events: Sequence[Event]) -> bool:
    """The latest event that starts or ends the run is an end (finished, failed, cancelled...)."""
    last = None
    for e in events:
        if e.event in (*RUN_ENDS, SUBMITTING, SUBMITTED):
            last = e.event
    return last in RUN_ENDS


def withdraw_rescues(paths: RunPaths, scheduler: Any, *, role: str) -> list[str]:
    """The run has ended for good: cancel its rescue jobs that still wait (they would only start to
    find nothing to do, or linger held on a job that is gone). Returns the ids withdrawn."""
    events = read_events(paths).events
    if not run_has_ended(events):
        return []
    own = next((os.environ[v] for v in SELF_VARS if os.environ.get(v)), None)
    jobs = waiting_rescues(events, own=own)
    if not jobs:
        return []
    for job in jobs:
        with contextlib.suppress(HpclaunchError, ValueError):
            scheduler.cancel(paths, job)  # one that already ran (or was dropped) is gone: fine
    Ledger(paths, role=role).append(RESCUE_CANCELLED, rescue_jobs=jobs, reason="the run has ended")
    return jobs
