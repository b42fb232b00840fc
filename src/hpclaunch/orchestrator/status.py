"""What ``hpclaunch status`` shows: the story of a run from its ledger, metrics and the scheduler.

Pure functions over the ledger's events (tests feed them lists); one call asks the scheduler for its
own view of the current job. Never imports torch.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from ..estimate import Estimate
from ..rundir import SUBMITTED, Event, RunPaths, latest_submission, of_kind, read_events
from ..rundir.cause import STOP_CAUSES, Cause, UnknownCause
from ..rundir.events import (
    Cancelled,
    CheckpointFailed,
    CheckpointSaved,
    Ended,
    Failed,
    Finished,
    Held,
    Refused,
    Requeued,
    Rescue,
    RescueCancelled,
    RescueSubmitted,
    Resumed,
    ScheduleChanged,
    Started,
    Stopped,
    StopRequested,
    SubmitFailed,
    Submitted,
    Submitting,
)
from ..rundir.metrics import MetricsLine, read_metrics
from ..rundir.readers import read_total_steps
from ..schedulers.protocol import ACTIVE_STATES
from ..templates.shell import quote
from .accounting import RunTime, metrics_steps_by_attempt
from .checkpoint_interval import IntervalSummary, checkpoint_interval_summary
from .cost import run_cost
from .lineage import ChainView, WeightsSource, chain_view, weights_from
from .memory_tier_view import MemoryTierView, memory_tier_view
from .stragglers import StragglerSummary, straggler_summary
from .time_inputs import run_time
from .write_failures import (
    ExperimentLogFailure,
    FailedSaves,
    experiment_log_failures,
    failed_saves,
)

# What an ended attempt's state reads while its job or process is still exiting (the scheduler
# still runs it, or a live process holds the run lock): not resumable yet, and said so.
ENDING_STATES = {
    "stopped": "stopping",
    "finished": "finishing",
    "failed": "failing",
    "cancelled": "cancelling",
}

# A continuation the scheduler does not show as pending or running this long after the ledger
# said "requeued" never came: the run is reported as lost (and `submit --wait` ends).
LOST_AFTER_S = 60.0


@dataclass
class Attempt:
    attempt: str
    job_id: str | None = None
    restart_count: int | None = None
    nodes: int | None = None
    hosts: list[str] = field(default_factory=list)
    world_size: int | None = None
    started: float | None = None
    ended: float | None = None
    resumed_step: int | None = None
    last_step: int | None = None  # last step this attempt completed
    checkpoint_step: int | None = None  # newest checkpoint saved during this attempt
    # running | finished | stopped | requeued | restarted in place | failed | cancelled | withdrawn | refused
    end: str = "running"
    in_place: bool = False  # this attempt was started by the allocation's agents, not the scheduler
    replaced: dict[str, str] = field(default_factory=dict)  # node -> the spare that took its place
    cause: str | None = None
    error: str | None = None
    failed_saves: int = 0  # saves that failed in this attempt (each then saved again, blocking)
    resumed_from: str | None = None  # "memory" or "disk" with the memory tier on (else None)
    memory_saved_steps: int | None = None  # resumed from memory: steps past the newest disk checkpoint


def steps_text(a: Attempt, arrow: str = "→") -> str:
    """An attempt's steps for a table: "35→90", with the tier it resumed from when the memory tier
    is on ("35→90 (memory, +15)": 15 steps past the newest checkpoint on disk; "40→90 (disk)")."""
    if a.resumed_step is None:
        return "-"
    text = f"{a.resumed_step}{arrow}{a.last_step}"
    if a.resumed_from == "memory" and a.memory_saved_steps is not None:
        text += f" (memory, +{a.memory_saved_steps})"
    elif a.resumed_from == "disk":  # (the memory tier on, and the disk served)
        text += " (disk)"
    return text


@dataclass
class StepCounts:
    """The steps beside goodput (which counts time: ``accounting``): kept of computed."""

    useful_steps: int
    computed_steps: int
    repeated_steps: int  # computed more than once (work lost to a stop without a save)
    lost_steps: int  # never computed (a resume that skipped ahead): data silently not trained on
    kept_ratio: float  # useful / computed steps; not goodput (that is time: kept training / allocated)


def attempts_from_events(events: Sequence[Event]) -> list[Attempt]:
    by_key: dict[str, Attempt] = {}
    order: list[str] = []
    for e in events:
        key = e.attempt
        if not key:
            continue
        if key not in by_key:
            by_key[key] = Attempt(attempt=key)
            order.append(key)
        _apply(by_key[key], e)
    attempts = [by_key[k] for k in order]
    for a, b in itertools.pairwise(attempts):
        # b resumed from a checkpoint on disk newer than a's start: a saved it, even where its ranks
        # died before they recorded the background save's end
        if b.resumed_from != "memory" and b.resumed_step and b.resumed_step > (a.resumed_step or 0):
            a.checkpoint_step = max(a.checkpoint_step or 0, b.resumed_step)
    return attempts


def _apply(a: Attempt, e: Event) -> None:
    """What one event of the attempt ``a`` says about it."""
    if isinstance(e, Started) and (a.started is None or (e.node or 0) == 0):
        a.started = a.started or e.ts
        a.in_place = bool(_given(e, "in_place", e.in_place, a.in_place))
        a.job_id = _given(e, "job_id", e.job_id, a.job_id)
        a.restart_count = _given(e, "restart_count", e.restart_count, a.restart_count)
        a.nodes = _given(e, "nodes", e.nodes, a.nodes)
        a.hosts = e.hosts if e.hosts is not None else a.hosts
        a.world_size = _given(e, "world_size", e.world_size, a.world_size)
    elif isinstance(e, Resumed):
        a.resumed_step = e.step or 0
        a.world_size = _given(e, "world_size", e.world_size, a.world_size)
        a.last_step = max(a.last_step or 0, a.resumed_step)
        a.resumed_from = e.tier
        if e.tier == "memory":
            a.memory_saved_steps = a.resumed_step - (e.disk_step or 0)
    elif isinstance(e, CheckpointSaved):
        step = e.step or 0
        a.checkpoint_step = max(a.checkpoint_step or 0, step)
        a.last_step = max(a.last_step or 0, step)
    elif isinstance(e, CheckpointFailed):
        a.failed_saves += 1
    elif isinstance(e, Stopped):
        a.last_step = max(a.last_step or 0, e.step or 0)
        a.end, a.cause, a.ended = "stopped", _cause(e.cause), e.ts
    elif isinstance(e, Finished):
        if e.step is not None:
            a.last_step = max(a.last_step or 0, e.step)
        # a warning that came after the last step does not make the attempt's end a stop
        a.end, a.ended, a.cause = "finished", e.ts, None
    elif isinstance(e, Requeued):
        cause = _cause(e.cause)
        a.end, a.cause, a.ended = "requeued", cause, e.ts
        if e.step is not None:  # the step its ranks reached (a script logs when it likes)
            a.last_step = max(a.last_step or 0, e.step)
        if e.in_place:  # the allocation's agents went on: no new job, no queue
            a.end, a.replaced = "restarted in place", dict(e.replaced)
        # A failure that was retried says what failed (the decision's reason; older ledgers
        # kept it in "error"); a stop that was continued has nothing to explain.
        failed = cause is not None and cause not in STOP_CAUSES
        a.error = (e.error or e.reason) if failed else None
    elif isinstance(e, Failed):
        a.end, a.cause, a.ended, a.error = "failed", _cause(e.cause), e.ts, e.error
        if e.step is not None:
            a.last_step = max(a.last_step or 0, e.step)
    elif isinstance(e, Ended):
        a.end, a.cause, a.ended = "stopped", _cause(e.cause), e.ts
    elif isinstance(e, Held):
        a.end, a.ended, a.error = "withdrawn", e.ts, e.reason
    elif isinstance(e, Refused):
        a.end, a.ended, a.error = "refused", e.ts, e.reason
    elif isinstance(e, Cancelled):
        a.end, a.cause, a.ended = "cancelled", Cause.CANCELLED.value, e.ts
    elif isinstance(e, StopRequested) and a.cause is None:
        a.cause = _cause(e.cause)


T = TypeVar("T")


def _given(e: Event, name: str, value: T | None, before: T | None) -> T | None:
    """``value`` where the line wrote the field (a null included), else what was known before."""
    return value if name in e.record else before


def _cause(value: str | None) -> str | None:
    """An event's cause as recorded; one this version does not know is shown as it was written
    (marked), never mistaken for another."""
    try:
        cause = Cause.parse_optional(value)
    except UnknownCause:
        return f"{value} (unknown cause)"
    return cause.value if cause is not None else None


def step_counts(attempts: list[Attempt]) -> StepCounts:
    """Steps are computed in [resumed_step+1, last_step] per attempt."""
    computed = repeated = lost = 0
    frontier = 0  # highest step computed so far
    for a in attempts:
        if a.resumed_step is None or a.last_step is None:
            continue
        start, end = a.resumed_step, a.last_step
        computed += max(0, end - start)
        repeated += max(0, min(end, frontier) - start)
        lost += max(0, start - frontier)
        frontier = max(frontier, end)
    useful = frontier - lost
    return StepCounts(useful, computed, repeated, lost, round(useful / computed, 4) if computed else 1.0)


@dataclass(frozen=True)
class SchedulerView:
    """The scheduler's own word on the run's current job."""

    state: str
    raw: str | None
    reason: str | None


@dataclass(frozen=True)
class RescueView:
    """The rescue job waiting behind the current job, and what rescues did before."""

    job_id: str | None
    notes: list[str]


def running_attempt(events: Sequence[Event]) -> str | None:
    """The attempt that has started and not ended yet (None: none runs now)."""
    attempts = attempts_from_events(events)
    return attempts[-1].attempt if attempts and attempts[-1].end == "running" else None


def current_job_id(events: Sequence[Event]) -> str | None:
    """The job id to ask the scheduler about: the latest submission or continuation."""
    job_id = None
    for e in events:
        if isinstance(e, (Submitted, Requeued)) and e.job_id:
            job_id = e.job_id
    return job_id


def rescue_view(events: Sequence[Event]) -> RescueView:
    """The rescue job waiting behind the run's current job (``schedulers.rescue_job``), and one line per
    job the scheduler ended undecided that a rescue continued (why the scheduler calls it FAILED)."""
    waiting: dict[str, str] = {}  # watched job -> its rescue
    notes: list[str] = []
    for e in events:
        if isinstance(e, (Submitting, Submitted)) and not e.resume:
            waiting.clear()
        elif isinstance(e, RescueSubmitted) and e.rescue_job:
            waiting[str(e.job_id)] = e.rescue_job
        elif isinstance(e, RescueCancelled):
            gone = set(e.rescue_jobs)
            waiting = {k: v for k, v in waiting.items() if v not in gone}
        elif isinstance(e, Requeued) and e.by == "rescue":
            hosts = ", ".join(e.exclude) or "?"
            said = f" {e.job_ended}" if e.job_ended else ""
            notes.append(
                f"job {e.for_job}{said}: its batch host died with its attempt undecided; the rescue "
                f"(job {e.rescue_job or '?'}) continued the run as job {e.job_id} without {hosts}"
            )
    notes += _decided_before_the_rescue(events)
    job = current_job_id(events)
    return RescueView(waiting.get(job) if job else None, notes)


def _failed_for_a_node_replaced_in_place(
    attempts: Sequence[Attempt], job_id: str | None, sched: SchedulerView
) -> list[str]:
    """Why the scheduler calls a job failed that went on: a node of it died, a spare took its place
    in the same job, and the scheduler still counts the task that died with that node."""
    said = sched.raw or sched.state
    return [
        f"job {job_id} {said}: the scheduler counts the task that died with {', '.join(a.replaced)}; "
        f"the run went on in the same job on {', '.join(a.replaced.values())}"
        for a in attempts
        if job_id and a.job_id == job_id and a.cause == Cause.NODE_FAILURE.value and a.replaced
    ]


def _decided_before_the_rescue(events: Sequence[Event]) -> list[str]:
    """A job the scheduler ended in a failed state after an agent had decided its attempt and
    continued the run elsewhere (the agents left took over from the dead batch host in time)."""
    continued = {str(e.attempt): e for e in of_kind(events, Requeued) if not e.in_place}
    notes = []
    for e in of_kind(events, Rescue):
        decided = continued.get(str(e.attempt))
        if e.action != "nothing" or not e.job_ended:
            continue
        if decided is None or str(decided.job_id) == str(e.job_id):
            continue
        notes.append(
            f"job {e.job_id} {e.job_ended}: its batch host died after its attempt was decided "
            f"({decided.cause}); the run continued as job {decided.job_id}"
        )
    return notes


def run_state(
    attempts: list[Attempt],
    events: Sequence[Event],
    scheduler_state: str | None,
    *,
    now: float | None = None,
    exiting: bool = False,
) -> str:
    """The run's state: the ledger's story reconciled with what the scheduler says now.
    ``exiting``: a live process (agent, controller, foreground train) still holds the run lock."""
    submissions = [e for e in events if isinstance(e, (Submitting, SubmitFailed))]
    if submissions and isinstance(submissions[-1], SubmitFailed):
        return "not submitted (the scheduler refused it)"
    if not attempts:
        if of_kind(events, Cancelled):
            return "cancelled"
        if not of_kind(events, Submitted):
            return "unknown"
        return _lost_or(scheduler_state, "pending", since=_last_ts(events, SUBMITTED), now=now)
    # An attempt that was withdrawn or refused did not change the run: it keeps its state.
    ran = [a for a in attempts if a.end not in ("withdrawn", "refused")] or attempts
    last = ran[-1]
    if _cancelled_after(events, last):
        return "cancelled"
    if (since := _submitted_after(events, last)) is not None:
        # `submit --resume` (or a chain's next job) after the attempt ended: the new job is the
        # run's now, and it has not started an attempt yet. The old attempt's end is not the state.
        return _lost_or(scheduler_state, "pending", since=since, now=now)
    if last.end == "running":
        if scheduler_state in ("running", None):
            return "running"
        if scheduler_state in ("cancelled",):
            return "cancelled"
        if scheduler_state in ("timeout", "failed", "node_fail", "completed", "unknown", "preempted"):
            return f"lost ({scheduler_state})"  # ended without the agent recording why
        return scheduler_state
    if last.end == "requeued":
        return _lost_or(scheduler_state, "requeued", since=last.ended, now=now)
    if last.end in ENDING_STATES and (exiting or scheduler_state in ACTIVE_STATES):
        return ENDING_STATES[last.end]
    return last.end


def _lost_or(scheduler_state: str | None, state: str, *, since: float | None, now: float | None) -> str:
    """``state``, unless the scheduler has shown no pending or running job for too long: then the
    job was cancelled while it waited (a user's scancel/qdel of a pending continuation: the run
    ended as the user said) or it is lost."""
    if scheduler_state is None or scheduler_state in ACTIVE_STATES:
        return state
    waited = (now or time.time()) - (since or 0)
    if waited <= LOST_AFTER_S:
        return state
    return "cancelled" if scheduler_state == "cancelled" else "lost"


def _last_ts(events: Sequence[Event], name: str) -> float | None:
    stamps = [e.ts for e in events if e.event == name]
    return float(stamps[-1]) if stamps and stamps[-1] is not None else None


def _submitted_after(events: Sequence[Event], last: Attempt) -> float | None:
    """When the run's latest submission was opened, if that came after ``last`` began (the ledger's
    order, not its clocks: its writers are on different hosts); None when ``last`` is that
    submission's own (or the run has no submission)."""
    opened = latest_submission(events)
    if opened < 0 or any(e.attempt == last.attempt for e in events[opened:]):
        return None
    return float(events[opened].ts or 0.0)


def _cancelled_after(events: Sequence[Event], last: Attempt) -> bool:
    """`hpclaunch cancel` writes an event outside any attempt: it ends the run."""
    start = last.started or 0
    return any((e.ts or 0) >= start for e in of_kind(events, Cancelled))


@dataclass(frozen=True)
class StatusView:
    """What ``hpclaunch status`` knows of a run; ``to_json()`` is its ``--json`` form.

    ``time`` holds the accounting as ``--json`` shows it (seconds rounded to the millisecond), so the
    text, the report and the JSON tell the same figures. The parts other modules own (stragglers,
    cost, chain, weights, checkpoint interval) stay as those modules give them.
    """

    run: str
    state: str
    hint: str | None
    ledger_warnings: list[str]
    job_id: str | None
    scheduler: SchedulerView | None
    step: int
    steps: int | None
    loss: float | None
    text_loss: float | None
    latent_loss: float | None
    samples_per_s: float | None
    tflops_per_gpu: float | None  # GPU runs on a GPU whose peak is known (trainer.metrics_window)
    mfu: float | None
    eta_s: float | None
    requeues: int
    attempts: list[Attempt]
    step_counts: StepCounts
    time: RunTime
    stragglers: StragglerSummary
    cost: Estimate | None  # shared with preflight's estimate
    chain: ChainView | None
    weights_from: WeightsSource | None
    checkpoint_interval: IntervalSummary | None
    rescue: RescueView
    failed_saves: FailedSaves | None
    experiment_logs: list[ExperimentLogFailure]
    memory_tier: MemoryTierView | None = None
    # A script's own scalars of its last logged step where it logs no ``loss`` (``run.log(loss_d=...,
    # loss_g=...)``), for the line status shows: at most three, in the order logged.
    logged: dict[str, float] = field(default_factory=dict)
    # What each resume changed of the LR schedule or the global batch, one line each, oldest first
    # (the ledger's schedule_changed, written at submit).
    schedule_changes: list[str] = field(default_factory=list)

    @property
    def run_name(self) -> str:
        return Path(self.run).name

    @property
    def in_flight(self) -> bool:
        """Mid-flight by the ledger, still exiting, or held by its scheduler (between a trainer's stop
        and the agent's requeue decision the ledger alone says "stopped")."""
        sched = self.scheduler.state if self.scheduler is not None else None
        return self.state in ACTIVE_STATES or self.state in ENDING_STATES.values() or sched in ACTIVE_STATES

    @property
    def goodput(self) -> float | None:
        """The time share: kept training over allocated time (``time.goodput``)."""
        return self.time.goodput

    def attempt(self, key: str) -> Attempt | None:
        return next((a for a in self.attempts if a.attempt == key), None)

    def to_json(self) -> dict[str, Any]:
        time_json = self.time.to_json()
        return {
            "run": self.run,
            "state": self.state,
            "hint": self.hint,
            "ledger_warnings": self.ledger_warnings,
            "job_id": self.job_id,
            "scheduler": asdict(self.scheduler) if self.scheduler is not None else None,
            "step": self.step,
            "steps": self.steps,
            "loss": self.loss,
            "logged": self.logged,
            "text_loss": self.text_loss,
            "latent_loss": self.latent_loss,
            "samples_per_s": self.samples_per_s,
            "tflops_per_gpu": self.tflops_per_gpu,
            "mfu": self.mfu,
            "eta_s": self.eta_s,
            "requeues": self.requeues,
            "attempts": [asdict(a) for a in self.attempts],
            # One word, one number: goodput is the time share the text shows (kept training over
            # allocated time, as time.goodput); the step counts have their own name.
            "goodput": time_json["goodput"],
            "step_counts": asdict(self.step_counts),
            "time": time_json,
            "stragglers": asdict(self.stragglers),
            "cost": self.cost.to_json() if self.cost is not None else None,
            "chain": self.chain.to_json() if self.chain is not None else None,
            "weights_from": asdict(self.weights_from) if self.weights_from is not None else None,
            "checkpoint_interval": asdict(self.checkpoint_interval) if self.checkpoint_interval else None,
            "rescue": asdict(self.rescue),
            "failed_saves": asdict(self.failed_saves) if self.failed_saves is not None else None,
            "experiment_logs": [asdict(f) for f in self.experiment_logs],
            "memory_tier": asdict(self.memory_tier) if self.memory_tier is not None else None,
            "schedule_changes": self.schedule_changes,
        }


def summarize(run: Path, *, scheduler_status: Any = None) -> StatusView:
    paths = RunPaths(run)
    log = read_events(paths)
    events = log.events
    metrics = read_metrics(paths.metrics)
    attempts = attempts_from_events(events)
    _add_unsaved_steps(attempts, metrics)
    last = metrics[-1] if metrics else None
    total_steps = read_total_steps(paths, events)
    step = max([a.last_step or 0 for a in attempts] + [last.step or 0 if last else 0])
    sched = None
    if scheduler_status is not None:
        sched = SchedulerView(scheduler_status.state.value, scheduler_status.raw, scheduler_status.reason)
    speed = last.step_time_s if last else None
    eta = round((total_steps - step) * float(speed), 1) if speed and total_steps else None
    rescue = rescue_view(events)
    if sched is not None and sched.state in ("failed", "node_fail"):
        rescue.notes.extend(_failed_for_a_node_replaced_in_place(attempts, current_job_id(events), sched))
    state = run_state(attempts, events, sched.state if sched else None, exiting=_held_by_a_process(paths))
    if state == "cancelled" and attempts and attempts[-1].end == "running":
        # `hpclaunch cancel` ended the run; the job is being killed and its agent has not said yet
        # how the attempt ended (a few seconds): it is not running on, it is cancelling.
        attempts[-1].end = "cancelling"
    spent = run_time(run, events=events, metrics=metrics, live=state == "running")
    cost = run_cost(paths, spent, state=state, step=step, total_steps=total_steps)
    if cost is not None and cost.eta_s is not None:
        eta = round(cost.eta_s, 4)  # wall clock: attempts still to come, each with its start-up and stop
    if state not in ACTIVE_STATES and state != "finished":
        eta = None  # stopped, failed, cancelled: nothing arrives until someone resumes it
    return StatusView(
        run=str(run),
        state=state,
        hint=_hint(state, run, current_job_id(events), rescue=rescue.job_id),
        ledger_warnings=log.torn,
        job_id=current_job_id(events),
        scheduler=sched,
        step=step,
        steps=total_steps,
        loss=last.loss if last else None,
        logged=last.own_scalars() if last is not None and last.loss is None else {},
        text_loss=last.text_loss if last else None,
        latent_loss=last.latent_loss if last else None,
        samples_per_s=last.samples_per_s if last else None,
        tflops_per_gpu=last.value("tflops_per_gpu") if last else None,
        mfu=last.value("mfu") if last else None,
        eta_s=eta,
        requeues=len(of_kind(events, Requeued)),
        attempts=attempts,
        step_counts=step_counts(attempts),
        time=spent.rounded(),
        stragglers=straggler_summary(paths, events),
        cost=cost,
        chain=chain_view(paths),
        weights_from=weights_from(events),
        checkpoint_interval=checkpoint_interval_summary(events),
        rescue=rescue,
        failed_saves=failed_saves(events),
        experiment_logs=experiment_log_failures(events),
        memory_tier=memory_tier_view(paths, events),
        schedule_changes=[e.line for e in of_kind(events, ScheduleChanged) if e.line],
    )


def _held_by_a_process(paths: RunPaths) -> bool:
    """A live agent, controller or foreground train holds the run lock: it has not exited yet."""
    from ..rundir import RunLock
    from ..rundir.lock import PROCESS_ROLES, liveness

    holder = RunLock(paths).read()
    return holder is not None and holder.role in PROCESS_ROLES and liveness(holder, is_active=None).alive


def _add_unsaved_steps(attempts: list[Attempt], metrics: list[MetricsLine]) -> None:
    """A crash's steps after its last checkpoint are in metrics.jsonl only: count them as computed."""
    logged = metrics_steps_by_attempt(metrics)
    for a in attempts:
        if a.attempt in logged and a.resumed_step is not None:
            a.last_step = max(a.last_step or 0, logged[a.attempt])


def _hint(state: str, run: Path, job_id: str | None, *, rescue: str | None = None) -> str | None:
    if state == "lost":
        return (
            f"the scheduler shows no pending or running job for this run (last job {job_id or '?'}); "
            f"continue it with: hpclaunch submit --resume {quote(run)}"
        )
    if state.startswith("lost (") and rescue is not None:
        return f"the job ended without its agent recording why; its rescue job {rescue} decides the attempt"
    if state.startswith("lost ("):
        return f"the job ended without its agent recording why; see hpclaunch logs {quote(run)}"
    return None
