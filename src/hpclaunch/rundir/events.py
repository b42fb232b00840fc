"""The ledger's events as types: one frozen record per event kind, read from the lines on disk.

A line is parsed into the record of its kind (``parse_event``); the common fields every writer
stamps (``ts``, ``seq``, ``attempt``, ``node``, ``host``, ``pid``, ``writer``) are on ``Event``
itself. Parsing is forgiving, because the ledger outlives the code that wrote it: a field missing
from an older line is None (or empty), a field of the wrong JSON type (a damaged or foreign line) is
treated as missing, and a kind this version does not know (a newer writer) is a plain ``Event``.
The line itself is kept as ``record``, so nothing a newer writer added is lost to a reader that
wants it. Values are kept as written (an integral ``ts`` stays an int), so what is shown from them
does not change.

The writers still append keyword fields (``Ledger.append``); the names here are the names they
write, and ``tests/unit/test_rundir.py`` holds the two together.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, TypedDict, TypeVar

from . import kinds as k
from .attempt_records import RosterJSON


@dataclass(frozen=True, kw_only=True)
class Event:
    """One ledger line: what every writer stamps on it. A kind this version does not know is read
    as this (its fields are in ``record``)."""

    KIND: ClassVar[str] = ""

    event: str
    ts: float | None = None
    seq: int | None = None
    attempt: str | None = None
    node: int | None = None  # the writer's node (an agent's); None for the CLI and the trainer
    host: str | None = None
    pid: int | None = None
    writer: str | None = None  # the writer's role: cli, agent, trainer, controller, ...
    # the line as read: a free-form JSON object (every field, a newer writer's included)
    record: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)


# ---- the CLI: submission, stop, cancel, chain ---------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class _Submission(Event):
    job_id: str | None = None
    scheduler: str | None = None
    script: str | None = None
    resume: bool | None = None
    world_size: int | None = None
    preflight: str | None = None


@dataclass(frozen=True, kw_only=True)
class Submitting(_Submission):
    KIND = k.SUBMITTING


@dataclass(frozen=True, kw_only=True)
class Submitted(_Submission):
    KIND = k.SUBMITTED


@dataclass(frozen=True, kw_only=True)
class SubmitFailed(Event):
    KIND = k.SUBMIT_FAILED
    error: str | None = None


@dataclass(frozen=True, kw_only=True)
class StopDropped(Event):
    KIND = k.STOP_DROPPED
    by: str | None = None
    requested_at: float | None = None


@dataclass(frozen=True, kw_only=True)
class PreflightSkipped(Event):
    KIND = k.PREFLIGHT_SKIPPED
    by: str | None = None


@dataclass(frozen=True, kw_only=True)
class ScheduleChanged(Event):
    """A resume that changes the LR schedule or the global batch (``lr_schedule.ResumeChange``)."""

    KIND = k.SCHEDULE_CHANGED
    step: int | None = None  # the first step the resume trains
    rule: str | None = None
    steps_before: int | None = None
    steps_after: int | None = None
    length_before: int | None = None
    length_after: int | None = None
    lr_before: float | None = None
    lr_after: float | None = None
    lr_other_rule: float | None = None
    batch_before: int | None = None
    batch_after: int | None = None
    line: str | None = None


@dataclass(frozen=True, kw_only=True)
class StopRequested(Event):
    KIND = k.STOP_REQUESTED
    cause: str | None = None
    source: str | None = None
    by: str | None = None


@dataclass(frozen=True, kw_only=True)
class _ChainStep(Event):
    after: str | None = None  # (the later run's ledger) the run it waits for
    next: str | None = None  # (the earlier run's ledger) the run waiting for it
    job_id: str | None = None
    reason: str | None = None
    by: str | None = None
    error: str | None = None
    retry: bool | None = None


@dataclass(frozen=True, kw_only=True)
class ChainWaiting(_ChainStep):
    KIND = k.CHAIN_WAITING


@dataclass(frozen=True, kw_only=True)
class ChainReleased(_ChainStep):
    KIND = k.CHAIN_RELEASED


@dataclass(frozen=True, kw_only=True)
class ChainBlocked(_ChainStep):
    KIND = k.CHAIN_BLOCKED


@dataclass(frozen=True, kw_only=True)
class RescueSubmitted(Event):
    KIND = k.RESCUE_SUBMITTED
    job_id: str | None = None  # the job it watches
    rescue_job: str | None = None


@dataclass(frozen=True, kw_only=True)
class RescueNotSubmitted(Event):
    KIND = k.RESCUE_NOT_SUBMITTED
    job_id: str | None = None
    error: str | None = None


@dataclass(frozen=True, kw_only=True)
class RescueCancelled(Event):
    KIND = k.RESCUE_CANCELLED
    rescue_jobs: list[str] = field(default_factory=list)
    reason: str | None = None


# ---- the node agents: an attempt's start, checks and decision -----------------------------------


@dataclass(frozen=True, kw_only=True)
class Started(Event):
    """One per node per attempt (``jobs.agent_records.started_fields``)."""

    KIND = k.STARTED
    scheduler: str | None = None
    job_id: str | None = None
    restart_count: int | None = None
    nodes: int | None = None
    hosts: list[str] | None = None
    world_size: int | None = None
    end_time: float | None = None  # the scheduler's end of the allocation (older runs' clock)
    clock: dict[str, float | None] | None = None  # rundir.clock.AttemptClock.to_json()
    in_place: bool | None = None
    previous: str | None = None  # in place: the attempt it restarts
    roster: RosterJSON | None = None  # in place: the roster it restarts on


class CheckRow(TypedDict):
    """One check as a node reported it: preflight's result, less its hint and time."""

    name: str
    status: str  # pass | warn | fail | skip
    finding: str


@dataclass(frozen=True, kw_only=True)
class NodePreflight(Event):
    KIND = k.NODE_PREFLIGHT
    ok: bool | None = None
    checks: list[CheckRow] = field(default_factory=list)  # one row per check


@dataclass(frozen=True, kw_only=True)
class NcclPreset(Event):
    KIND = k.NCCL_PRESET
    preset: str | None = None
    reason: str | None = None
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class Refused(Event):
    KIND = k.REFUSED
    reason: str | None = None
    holder: str | None = None


@dataclass(frozen=True, kw_only=True)
class NodeExcluded(Event):
    KIND = k.NODE_EXCLUDED
    nodes: list[str] = field(default_factory=list)
    excluded: str | None = None  # older ledgers: one node
    reason: str | None = None
    by: str | None = None


@dataclass(frozen=True, kw_only=True)
class NodeReplaced(Event):
    KIND = k.NODE_REPLACED
    nodes: list[str] = field(default_factory=list)
    spare: str | None = None
    reason: str | None = None


@dataclass(frozen=True, kw_only=True)
class StopOverdue(Event):
    KIND = k.STOP_OVERDUE
    cause: str | None = None
    reason: str | None = None


@dataclass(frozen=True, kw_only=True)
class Hang(Event):
    """``jobs.watchdog.Verdict.ledger_fields()``: the culprits and a sample of the ranks' states."""

    KIND = k.HANG
    phase: str | None = None
    step: int | None = None
    culprit: str | None = None
    ranks: list[int] = field(default_factory=list)
    culprit_node: str | None = None
    reason: str | None = None
    window_s: float | None = None
    stalled_s: float | None = None
    source: str | None = None


@dataclass(frozen=True, kw_only=True)
class Straggler(Event):
    """``jobs.straggler_tracker.Straggler``: ``rank_node`` is where the rank runs (``node`` is the writer's)."""

    KIND = k.STRAGGLER
    rank: int | None = None
    rank_node: str | None = None
    step: int | None = None
    work_s: float | None = None
    fastest_s: float | None = None
    fastest_rank: int | None = None
    ratio: float | None = None
    windows: int | None = None
    reason: str | None = None


@dataclass(frozen=True, kw_only=True)
class _Decision(Event):
    """The decision on an attempt (``jobs.agent_records.decision_fields``; the rescue's adds which
    job it continued and how the scheduler ended it)."""

    cause: str | None = None
    reason: str | None = None
    action: str | None = None
    error: str | None = None
    exclude: list[str] = field(default_factory=list)
    step: int | None = None  # the step the attempt reached
    job_id: str | None = None
    by: str | None = None  # agent | rescue | chain | the CLI's cancel
    in_place: bool | None = None
    counts_as: str | None = None  # the budget a continuation spent, when not its cause's
    replaced: dict[str, str] = field(default_factory=dict)  # node -> the spare in its place
    suspect: str | None = None
    checkpoint: int | None = None  # what a continuation resumes from
    note: str | None = None
    for_job: str | None = None  # (rescue) the job whose attempt it decided
    rescue_job: str | None = None
    job_ended: str | None = None  # (rescue) how the scheduler ended that job


@dataclass(frozen=True, kw_only=True)
class Requeued(_Decision):
    KIND = k.REQUEUED


@dataclass(frozen=True, kw_only=True)
class Finished(_Decision):
    KIND = k.FINISHED


@dataclass(frozen=True, kw_only=True)
class Failed(_Decision):
    KIND = k.FAILED


@dataclass(frozen=True, kw_only=True)
class Cancelled(_Decision):
    KIND = k.CANCELLED


@dataclass(frozen=True, kw_only=True)
class Ended(_Decision):
    KIND = k.ENDED


@dataclass(frozen=True, kw_only=True)
class Held(_Decision):
    KIND = k.HELD


@dataclass(frozen=True, kw_only=True)
class Rescue(Event):
    KIND = k.RESCUE
    job_id: str | None = None
    action: str | None = None
    reason: str | None = None
    job_ended: str | None = None


@dataclass(frozen=True, kw_only=True)
class AgentError(Event):
    KIND = k.AGENT_ERROR
    error: str | None = None
    errno: str | None = None  # ESTALE, EIO, ...: a filesystem error that outlasted its retries


# ---- the trainer's rank 0 -----------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Resumed(Event):
    KIND = k.RESUMED
    step: int | None = None  # 0: a fresh start
    checkpoint: str | None = None
    world_size: int | None = None
    samples_consumed: int | None = None
    parallel: str | None = None
    process_start: float | None = None
    startup_s: dict[str, float] | None = None  # the trainer's own start-up parts, when it reports them
    tier: str | None = None  # "memory" or "disk" (None: before the memory tier, or a fresh start)
    disk_step: int | None = None  # the newest checkpoint on disk then (the memory tier's gain over it)
    memory_reason: str | None = None  # with the memory tier, why the disk served (or nothing did)
    shards_from: dict[str, list[int]] | None = None  # from memory: node -> the ranks whose shards it served
    total_steps: int | None = None  # the steps the run trains to (a script's run.steps(total=...))


@dataclass(frozen=True, kw_only=True)
class Initialized(Event):
    KIND = k.INITIALIZED
    init_from: str | None = None
    checkpoint: str | None = None
    run: str | None = None
    step: int | None = None
    ema: bool | None = None
    source_world_size: int | None = None
    source_parallel: str | None = None


@dataclass(frozen=True, kw_only=True)
class CheckpointSaved(Event):
    KIND = k.CHECKPOINT_SAVED
    step: int | None = None
    path: str | None = None
    seconds: float | None = None
    bytes: int | None = None
    blocking: bool | None = None
    stall_s: float | None = None  # the part that blocked training (an asynchronous save's)


@dataclass(frozen=True, kw_only=True)
class CheckpointInvalid(Event):
    KIND = k.CHECKPOINT_INVALID
    path: str | None = None
    reason: str | None = None


@dataclass(frozen=True, kw_only=True)
class CheckpointFailed(Event):
    KIND = k.CHECKPOINT_FAILED
    step: int | None = None
    error: str | None = None
    action: str | None = None


@dataclass(frozen=True, kw_only=True)
class CheckpointSuperseded(Event):
    # (its writer writes "writer": "process" over the common field: which writer it dropped)
    KIND = k.CHECKPOINT_SUPERSEDED
    step: int | None = None


@dataclass(frozen=True, kw_only=True)
class SnapshotSaved(Event):
    KIND = k.SNAPSHOT_SAVED
    step: int | None = None
    seconds: float | None = None  # the background job: own copy written, buddy's sent, published
    stall_s: float | None = None  # what training waited for: the previous job, the state dict, staging
    stall_parts: dict[str, float] | None = None  # wait, state, layout, decide (auto) (seconds)
    copy_wait_s: float | None = None  # what the next optimizer update waited for the staging copies
    beside_s: float | None = None  # the slowdown of the steps its job ran beside (copy_wait_s included)
    whole_s: float | None = None  # its whole cost: stall_s + beside_s
    bytes: int | None = None  # this rank's shard (rank 0's, who writes the ledger)


@dataclass(frozen=True, kw_only=True)
class SnapshotInterval(Event):
    """The memory tier's next snapshot (``every_steps: auto``; ``rank.snapshots.snapshot_interval``)."""

    KIND = k.SNAPSHOT_INTERVAL
    step: int | None = None
    next_step: int | None = None
    interval_steps: int | None = None
    interval_s: float | None = None
    step_time_s: float | None = None
    whole_cost_s: float | None = None
    mtbf_s: float | None = None
    expected_loss_per_failure_s: float | None = None
    expected_waste_share: float | None = None


@dataclass(frozen=True, kw_only=True)
class SnapshotFailed(Event):
    """Said once per rank and attempt (each rank writes its own): later failures are only counted."""

    KIND = k.SNAPSHOT_FAILED
    step: int | None = None
    error: str | None = None
    rank: int | None = None
    node_name: str | None = None  # the node as the scheduler names it


@dataclass(frozen=True, kw_only=True)
class CheckpointWriterStarved(Event):
    KIND = k.CHECKPOINT_WRITER_STARVED
    step: int | None = None
    run_queue_share: float | None = None
    nice: int | None = None


@dataclass(frozen=True, kw_only=True)
class CheckpointInterval(Event):
    """``rank.checkpoint.save_interval``'s decision (``orchestrator.checkpoint_interval``)."""

    KIND = k.CHECKPOINT_INTERVAL
    step: int | None = None
    mode: str | None = None
    interval_steps: int | None = None
    interval_s: float | None = None
    next_step: int | None = None
    save_cost_s: float | None = None
    step_time_s: float | None = None
    mtbf_s: float | None = None
    expected_loss_per_failure_s: float | None = None
    expected_waste_share: float | None = None
    save_stall_s: float | None = None
    bounded_by: str | None = None
    unbounded_interval_s: float | None = None


@dataclass(frozen=True, kw_only=True)
class ExperimentLogFailed(Event):
    KIND = k.EXPERIMENT_LOG_FAILED
    step: int | None = None
    log: str | None = None
    error: str | None = None
    action: str | None = None


@dataclass(frozen=True, kw_only=True)
class Stopped(Event):
    KIND = k.STOPPED
    cause: str | None = None
    step: int | None = None


KINDS: dict[str, type[Event]] = {
    cls.KIND: cls
    for cls in (
        SnapshotSaved,
        SnapshotInterval,
        SnapshotFailed,
        Submitting,
        Submitted,
        SubmitFailed,
        StopDropped,
        PreflightSkipped,
        StopRequested,
        ScheduleChanged,
        ChainWaiting,
        ChainReleased,
        ChainBlocked,
        RescueSubmitted,
        RescueNotSubmitted,
        RescueCancelled,
        Started,
        NodePreflight,
        NcclPreset,
        Refused,
        NodeExcluded,
        NodeReplaced,
        StopOverdue,
        Hang,
        Straggler,
        Requeued,
        Finished,
        Failed,
        Cancelled,
        Ended,
        Held,
        Rescue,
        AgentError,
        Resumed,
        Initialized,
        CheckpointSaved,
        CheckpointInvalid,
        CheckpointFailed,
        CheckpointSuperseded,
        CheckpointWriterStarved,
        CheckpointInterval,
        ExperimentLogFailed,
        Stopped,
    )
}

# The events that decide an attempt (``status``, ``accounting``: how it ended).
Decided = Requeued | Finished | Failed | Cancelled | Ended | Held


def parse_event(record: Mapping[str, Any]) -> Event:
    """The typed record of one ledger line (a kind this version does not know: a plain ``Event``)."""
    cls = KINDS.get(str(record.get("event")), Event)
    hints = _hints(cls)
    values = {
        name: record[name]
        for name, hint in hints.items()
        if name in record and name != "record" and _fits(record[name], hint)
    }
    values["event"] = str(record.get("event"))
    return cls(**values, record=dict(record))


def as_events(events: Iterable[Event | Mapping[str, Any]]) -> list[Event]:
    """Typed events from typed ones or raw records (a test's ledger, written as dicts)."""
    return [e if isinstance(e, Event) else parse_event(e) for e in events]


E = TypeVar("E", bound=Event)


def of_kind(events: Iterable[Event], kind: type[E]) -> list[E]:
    return [e for e in events if isinstance(e, kind)]


_HINTS: dict[type[Event], dict[str, Any]] = {}


def _hints(cls: type[Event]) -> dict[str, Any]:
    """A kind's fields and their types, resolved when a line of that kind is first read (resolving
    all ~50 at import took ~0.1 s of every process's start: the CLI's, each agent's and rank's)."""
    if cls not in _HINTS:
        hints = typing.get_type_hints(cls)
        _HINTS[cls] = {f.name: hints[f.name] for f in fields(cls)}
    return _HINTS[cls]


def _fits(value: Any, hint: Any) -> bool:
    """Whether a JSON value is of the type a field declares (lists and dicts: their own type only)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, arg) for arg in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is Any:
        return True
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if typing.is_typeddict(hint):  # a record of its own (RosterJSON): a JSON object
        return isinstance(value, dict)
    return isinstance(value, origin or hint)
