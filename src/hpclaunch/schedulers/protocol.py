"""The small Protocol every scheduler implements, and the shared types.

A scheduler module answers what only it knows, on both sides of a job:

- login side: ``render`` (the exact script), ``submit`` (hands that script over, returns the job
  id), ``status`` (the scheduler's own view of a job), ``cancel``; ``submit_held`` and ``release``
  for a chain's next stage (held until the run before it has finished);
- allocation side (asked by the node agent): ``node_context`` (which node this is, of which job,
  until when), ``node_address`` (where other nodes reach a host), ``termination_cause`` (was a
  SIGTERM a time limit, a preemption or a cancellation), ``continue_job`` (come back after a stop:
  SLURM requeues itself, PBS submits a continuation job, local asks its controller),
  ``exclude_nodes`` (come back without some nodes, where the scheduler can express that) and
  ``withdraw`` (take back an attempt the scheduler started after the run had ended).

SLURM and PBS also leave a rescue job behind every job of a run (``schedulers.rescue_job``:
``render_rescue``, ``submit_rescue``, and ``continuation_held`` for the rescue's continuation);
these are optional (looked up with ``getattr``): the local scheduler's controller outlives its job.

What happens after an attempt is decided elsewhere (``jobs.decision_rules``, pure); the agent carries the
decision out through these methods. This package imports ``rundir``, ``config`` and ``templates``,
never the agent, the trainer or the orchestrator.
"""

from __future__ import annotations

import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Protocol

from .. import proc
from ..errors import HpclaunchError, SchedulerError
from ..fsutil import atomic_write_text
from ..rundir.cause import Cause
from ..rundir.clock import AttemptClock

if TYPE_CHECKING:
    from pathlib import Path

    from ..rundir import JobPlan, RunPaths


class JobState(str, Enum):
    """Scheduler states, never collapsed: a preemption is not a failure, a timeout not a crash."""

    PENDING = "pending"
    HELD = "held"  # waits for a person (PBS qhold / a system hold), not for resources
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
        """The job holds or waits for nodes: the one definition of "active" (status, lock, --wait)."""
        return self.value in ACTIVE_STATES


ACTIVE_STATES = ("pending", "held", "running", "suspended", "requeued")


@dataclass(frozen=True)
class RenderedJob:
    """A job script exactly as it will be handed to the scheduler."""

    text: str
    filename: str  # name inside the run directory: job.sbatch / job.pbs / job.local.sh
    warnings: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class SchedulerStatus:
    state: JobState
    raw: str  # the scheduler's own word for it (RUNNING, PREEMPTED, F, ...)
    reason: str = ""
    answered: bool = True  # False: the scheduler could not be asked (down, timed out); state UNKNOWN

    @property
    def active(self) -> bool | None:
        """Whether the job holds or waits for nodes; None when the scheduler could not be asked."""
        return self.state.active if self.answered else None


class NodeContextError(HpclaunchError):
    """The scheduler environment does not say what this node is (never guessed)."""


@dataclass(frozen=True)
class NodeContext:
    """This node of this attempt, as its scheduler describes it (built by ``node_context``)."""

    scheduler: str  # local | slurm | pbs
    job_id: str  # the id to requeue/cancel (array task: "<array>_<task>" on SLURM)
    node_rank: int
    num_nodes: int
    hostname: str  # this node, as the scheduler names it
    hosts: tuple[str, ...]  # every node of the allocation, head first
    restart_count: int = 0
    clock: AttemptClock | None = None  # this attempt's time, as the scheduler states it (None: no limit)
    array_task: int | None = None
    in_place: int = 0  # attempts this allocation restarted in place before this one (hpclaunch's count)

    @property
    def end_time(self) -> float | None:
        """``time.time()`` at which the scheduler ends this attempt."""
        return self.clock.end if self.clock is not None else None

    @property
    def head(self) -> str:
        return self.hosts[0]

    @property
    def is_head(self) -> bool:
        return self.node_rank == 0

    @property
    def allocation(self) -> str:
        """This allocation of the run: job id + the scheduler's restart count."""
        return f"{self.job_id}.{self.restart_count}"

    @property
    def attempt(self) -> str:
        """Unique per attempt of this run: the allocation, and for an attempt that the allocation's
        agents restarted in place, its number (``<job>.<restart>.<n>``)."""
        return self.allocation if not self.in_place else f"{self.allocation}.{self.in_place}"


@dataclass(frozen=True)
class Continuation:
    """How a job comes back: the job id that will run next and the agent's exit code."""

    job_id: str
    exit_code: int = 0
    by: str = "agent"  # agent (hpclaunch asked) | scheduler (it was already requeueing the job)
    # Submitted held: it starts once the decider has handed it the run's lock and released it (a
    # PBS sub-job's continuation, which cannot depend on the sub-job that is still running).
    held: bool = False


# Exit code a node agent uses to ask the local controller for another attempt (EX_TEMPFAIL).
LOCAL_REQUEUE_EXIT = 75


class Scheduler(Protocol):
    kind: str
    can_exclude_nodes: bool  # whether exclude_nodes can keep a continuation off named nodes

    # ---- login side ----
    def render(self, plan: JobPlan) -> RenderedJob: ...

    def submit(self, plan: JobPlan, rendered: RenderedJob) -> str: ...

    def status(self, paths: RunPaths, job_id: str) -> SchedulerStatus: ...

    def cancel(self, paths: RunPaths, job_id: str) -> None: ...

    # ---- chains (``schedulers.chain_release``): a next stage waits held until the run before it ends ----
    def submit_held(self, plan: JobPlan, rendered: RenderedJob) -> str:
        """``submit``, but the job does not start until ``release`` (SLURM ``sbatch --hold``, PBS
        ``qsub -h``, local: the controller waits); ``cancel`` takes it back."""
        ...

    def release(self, paths: RunPaths, job_id: str) -> None: ...

    # ---- allocation side ----
    def node_context(self, plan: JobPlan, environ: Mapping[str, str], *, now: float) -> NodeContext: ...

    def node_address(self, host: str) -> str: ...

    def termination_cause(self, paths: RunPaths, ctx: NodeContext, *, now: float) -> Cause:
        """What a SIGTERM received at ``now`` was: TIMEOUT, PREEMPTION or CANCELLED."""
        ...

    def continue_job(self, plan: JobPlan, paths: RunPaths, ctx: NodeContext) -> Continuation: ...

    def exclude_nodes(
        self, plan: JobPlan, paths: RunPaths, ctx: NodeContext, nodes: list[str]
    ) -> Continuation: ...

    def withdraw(self, paths: RunPaths, ctx: NodeContext) -> str:
        """Take back this attempt (started after the run ended); return what was done, in words."""
        ...

    def kill_grace_s(self, plan: JobPlan) -> float:
        """Seconds between the scheduler's SIGTERM and its SIGKILL (SLURM KillWait, PBS kill_delay)."""
        ...


# Seconds around the scheduler's end time within which a SIGTERM is the time limit itself. SLURM
# and PBS enforce limits on a periodic tick (SLURM every ~30 s), so the signal comes at or after
# the end time, never much before it; anything earlier is someone taking the nodes away.
END_SLACK_S = 2.0


def at_time_limit(ctx: NodeContext, now: float) -> bool:
    return ctx.end_time is not None and now >= ctx.end_time - END_SLACK_S


def spares_that_fit(plan: JobPlan, usable: int | None) -> int:
    """The hot spares a continuation can still hold when ``usable`` nodes are left to it (outside
    the nodes it avoids): fewer than the run's when fewer are left than its training nodes and spares
    need (a job asking for more never starts); all of them when the scheduler cannot say (None)."""
    if usable is None:
        return plan.spare_nodes
    return max(0, min(plan.spare_nodes, usable - plan.nodes))


def write_script(paths: RunPaths, rendered: RenderedJob) -> Path:
    """``rendered`` in the run directory, executable: the exact file handed to the scheduler."""
    script = paths.root / rendered.filename
    atomic_write_text(script, rendered.text, mode=0o755)
    return script


def run_command(
    argv: list[str], *, what: str, hint: str, cwd: Path | None = None, timeout: float = 60
) -> str:
    """Run a scheduler command (sbatch, scontrol, qsub, qdel...); its failure is a SchedulerError."""
    try:
        out = proc.run(argv, timeout=timeout, cwd=cwd)
    except FileNotFoundError:
        raise SchedulerError(f"{argv[0]} not found", where=what, hint=hint) from None
    except subprocess.TimeoutExpired:
        raise SchedulerError(f"{what} did not answer within {timeout:.0f} s", where=what) from None
    if out.returncode != 0:
        raise SchedulerError(f"{what} failed: {out.stderr.strip() or out.stdout.strip()}", where=what)
    return out.stdout


def env_int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    """An integer job variable; a missing one without default is a NodeContextError (never guessed)."""
    value = env.get(name)
    if value is None or value == "":
        if default is None:
            raise NodeContextError(f"{name} is not set", hint="is this running inside the job?")
        return default
    try:
        return int(value)
    except ValueError:
        raise NodeContextError(f"{name}={value!r} is not an integer") from None


def mem_directive(gb: float | None, *, lower: bool) -> str | None:
    """Memory per node for a directive: whole GB when it is whole, else MB (``gb``/``mb`` for PBS)."""
    if not gb:
        return None
    text = f"{int(gb)}GB" if gb == int(gb) else f"{int(gb * 1024)}MB"
    return text.lower() if lower else text
