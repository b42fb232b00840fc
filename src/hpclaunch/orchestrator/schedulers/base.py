"""The small Protocol every scheduler implements, and the shared result types.

Login-node side: ``render`` (the exact script), ``submit`` (hands that script over, returns the job
id), ``status`` (the scheduler's own view of the job), ``cancel``. Job side: ``continue_job`` (come
back after a stop: SLURM requeues itself, PBS submits a continuation job, local asks its controller).
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from ...errors import SchedulerError

if TYPE_CHECKING:
    from ...jobs.env import NodeContext
    from ..plan import JobPlan
    from ..runs import RunPaths


class JobState(str, Enum):
    """Scheduler states, never collapsed: a preemption is not a failure, a timeout not a crash."""

    PENDING = "pending"
    HELD = "held"  # waits for a person (PBS qhold / system hold), not for resources
    RUNNING = "running"
    SUSPENDED = "suspended"  # stopped in place (PBS preemption by suspension), not requeued
    REQUEUED = "requeued"
    PREEMPTED = "preempted"
    TIMEOUT = "timeout"
    NODE_FAIL = "node_fail"
    FAILED = "failed"
    COMPLETED = "completed"
    CANCELLED = "cancelled"
    UNKNOWN = "unknown"  # the scheduler no longer knows the job (the ledger still does)

    @property
    def active(self) -> bool:
        return self in (
            JobState.PENDING,
            JobState.HELD,
            JobState.RUNNING,
            JobState.SUSPENDED,
            JobState.REQUEUED,
        )


@dataclass(frozen=True)
class RenderedJob:
    """A job script exactly as it will be handed to the scheduler."""

    text: str
    filename: str  # name inside the run directory: job.sbatch / job.pbs / job.local.sh
    warnings: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class SchedulerStatus:
    state: JobState
    raw: str  # the scheduler's own word for it (RUNNING, PREEMPTED, C, ...)
    reason: str = ""


# Exit code a node agent uses to ask the local controller for another attempt (EX_TEMPFAIL).
LOCAL_REQUEUE_EXIT = 75


class Scheduler(Protocol):
    kind: str

    def render(self, plan: JobPlan) -> RenderedJob: ...

    def submit(self, plan: JobPlan, rendered: RenderedJob) -> str: ...

    def status(self, paths: RunPaths, job_id: str) -> SchedulerStatus: ...

    def cancel(self, paths: RunPaths, job_id: str) -> None: ...

    def termination_cause(self, paths: RunPaths, ctx: NodeContext, cause: str) -> str | None:
        """'cancelled' when the stop (``cause`` as the agent saw it) was a cancellation, else None."""
        ...

    def continue_job(self, plan: JobPlan, paths: RunPaths, ctx: NodeContext) -> str: ...


def run_command(
    argv: list[str], *, what: str, hint: str, cwd: Path | None = None, timeout: float = 60
) -> str:
    """Run a scheduler command (sbatch, scontrol, qsub, qdel...); its failure is a SchedulerError."""
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=cwd)
    except FileNotFoundError:
        raise SchedulerError(f"{argv[0]} not found", where=what, hint=hint) from None
    except subprocess.TimeoutExpired:
        raise SchedulerError(f"{what} did not answer within {timeout:.0f} s", where=what) from None
    if out.returncode != 0:
        raise SchedulerError(f"{what} failed: {out.stderr.strip() or out.stdout.strip()}", where=what)
    return out.stdout


def get_scheduler(kind: str) -> Scheduler:
    if kind == "slurm":
        from .slurm import SlurmScheduler

        return SlurmScheduler()
    if kind == "pbs":
        from .pbs import PbsScheduler

        return PbsScheduler()
    if kind == "local":
        from .local import LocalScheduler

        return LocalScheduler()
    raise ValueError(f"unknown scheduler {kind!r}")
