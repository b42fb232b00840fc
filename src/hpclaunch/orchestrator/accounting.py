"""Where a run's wall-clock time went: per attempt and for the run, and the time-based goodput.

Each attempt's allocation is cut into consecutive phases, so they add up to the allocated time:

    queue     submission (or the previous attempt's end) -> the allocation starts (apart: not allocated)
    startup   allocation start -> the trainer has resumed (job script, agent, node checks, rank host,
              imports, rendezvous, smoke test, data, model, checkpoint load)
    training  resumed -> the end of the last step a checkpoint kept, minus the checkpoint stalls in it
    stall     periodic saves: a synchronous save whole, an asynchronous one's blocking part (``stall_s``)
    lost      the end of the kept step -> the end of the last step computed (a crash's unsaved work)
    end_save  the last step -> the stop or final save is published
    idle      what is left: process teardown, the agent's decision, a crash's dying time

Goodput = training / allocated (queue excluded: it is reported apart). The allocation starts at
the scheduler's own start time where the attempt knows it (its end time minus the time limit: both
come from the scheduler), else when node 0's agent started. The end of a step is the ``ts`` of the
metrics line that closes its window (interpolated inside a window); a crashed attempt's steps after
its last metrics line come from rank 0's progress file and are marked estimated.

``account()`` is pure (tests feed it lists); ``time_inputs.run_time()`` reads a run directory for it.
Never imports torch.
"""

from __future__ import annotations

import copy
import itertools
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, TypeVar

from ..rundir import Event, of_kind
from ..rundir.clock import allocation_start
from ..rundir.events import (
    Cancelled,
    CheckpointSaved,
    Ended,
    Failed,
    Finished,
    Held,
    NodePreflight,
    Refused,
    Requeued,
    Resumed,
    Started,
    Stopped,
    Submitted,
)
from ..rundir.metrics import MetricsLine
from ..rundir.progress_files import ProgressRecord

PHASES = ("queue", "startup", "training", "stall", "lost", "end_save", "idle")
# Events with which node 0's agent (or the CLI) ends an attempt's allocation.
_ATTEMPT_ENDS = (Requeued, Finished, Failed, Ended, Cancelled, Held, Refused)
# The trainer's own start-up parts, as rank 0's ``resumed`` event reports them (when it does).
STARTUP_PARTS = ("imports", "distributed", "smoke", "data", "model", "load")


@dataclass(frozen=True)
class Stamped:
    """An event of an attempt with its time known (events without ``ts`` are not accounted)."""

    event: Event
    ts: float


@dataclass(frozen=True)
class _Evidence:
    """What one attempt left behind: its timed events, its metrics lines, rank 0's last progress."""

    attempt: str
    events: list[Stamped]
    lines: list[MetricsLine]
    progress: ProgressRecord | None


def _step(s: Stamped) -> int:
    """The step a ``resumed`` or ``checkpoint_saved`` event names (0 when it names none)."""
    e = s.event
    return (e.step or 0) if isinstance(e, (Resumed, CheckpointSaved)) else 0


@dataclass
class Segment:
    phase: str
    start: float
    end: float


@dataclass
class PhaseTimes:
    """Where allocated seconds went, phase by phase (``PHASES``): one attempt's, or a run's summed."""

    allocated_s: float = 0.0
    queue_s: float | None = None  # (an attempt's: None when nothing says how long it queued)
    startup_s: float = 0.0
    training_s: float = 0.0
    stall_s: float = 0.0
    lost_s: float = 0.0
    end_save_s: float = 0.0
    idle_s: float = 0.0
    lost_steps: int = 0
    goodput: float | None = None

    def phase_seconds(self) -> dict[str, float]:
        return {p: float(getattr(self, f"{p}_s") or 0.0) for p in PHASES}


@dataclass(kw_only=True)
class AttemptTime(PhaseTimes):
    attempt: str
    first_step: int | None = None  # the step it resumed from
    last_step: int | None = None  # the last step it computed
    kept_step: int | None = None  # the last step a checkpoint kept
    saves: int = 0  # periodic saves that stalled training
    running: bool = False
    startup_parts: dict[str, float] = field(default_factory=dict)
    estimated: list[str] = field(default_factory=list)  # which figures are estimates, and why
    segments: list[Segment] = field(default_factory=list)  # for the timeline figure


@dataclass
class RunTime(PhaseTimes):
    attempts: list[AttemptTime] = field(default_factory=list)
    queue_s: float = 0.0  # (every attempt's known wait, summed)

    def to_json(self) -> dict[str, Any]:
        """``status --json``'s ``time``, its keys in the order they have always had: the attempts
        first, each attempt's name first and its steps between its goodput and its lost steps."""
        out = asdict(self)
        return _rounded({"attempts": [_attempt_json(a) for a in out.pop("attempts")], **out})

    def rounded(self) -> RunTime:
        """The same figures as ``to_json()`` gives them (every float to the millisecond)."""
        return replace(
            _round_fields(self),
            attempts=[
                replace(
                    _round_fields(a),
                    startup_parts={k: round(v, 3) for k, v in a.startup_parts.items()},
                    segments=[_round_fields(s) for s in a.segments],
                )
                for a in self.attempts
            ],
        )


def _attempt_json(a: dict[str, Any]) -> dict[str, Any]:
    a["segments"] = [[s["phase"], s["start"], s["end"]] for s in a["segments"]]
    head = {"attempt": a.pop("attempt")}
    lost_steps = a.pop("lost_steps")
    out: dict[str, Any] = {}
    for key, value in a.items():
        out[key] = value
        if key == "kept_step":
            out["lost_steps"] = lost_steps
    return {**head, **out}


_D = TypeVar("_D", RunTime, AttemptTime, Segment)


def _round_fields(obj: _D) -> _D:
    """A copy of ``obj`` with its float fields rounded as ``_rounded`` rounds them in the JSON."""
    out = copy.copy(obj)
    for f in fields(out):
        if isinstance(value := getattr(out, f.name), float):
            setattr(out, f.name, round(value, 3))
    return out


# ---- the accounting (pure) ---------------------------------------------------------------------


def account(
    events: Sequence[Event],
    metrics: list[MetricsLine],
    *,
    time_limit_s: float | None = None,
    progress: dict[str, ProgressRecord] | None = None,
    live: bool = False,
    now: float | None = None,
) -> RunTime:
    """The time of every attempt in ``events`` (the merged ledger) and ``metrics`` (metrics.jsonl).

    ``progress``: rank 0's last progress record per attempt (the steps a crash did not log);
    ``live``: the last attempt is still running (its unsaved steps are not lost yet).
    """
    now = time.time() if now is None else now
    keys = attempt_keys(events)
    by_attempt = _group(events, keys)
    lines = _metrics_by_attempt(metrics, by_attempt, keys)
    resumed_at = [_resumed_step(by_attempt[k]) for k in keys]
    submits = sorted(float(e.ts) for e in of_kind(events, Submitted) if e.ts)
    out: list[AttemptTime] = []
    prev_end: float | None = None
    for i, key in enumerate(keys):
        later = [r for r in resumed_at[i + 1 :] if r is not None]
        a = _attempt_time(
            _Evidence(key, by_attempt[key], lines.get(key, []), (progress or {}).get(key)),
            time_limit_s=time_limit_s,
            next_resume=later[0] if later else None,
            live=live and i == len(keys) - 1,
            now=now,
            queue_from=_queue_from(submits, prev_end, by_attempt[key]),
            prev_end=prev_end,
        )
        prev_end = a.segments[-1].end if a.segments else prev_end
        out.append(a)
    return _totals(out)


def attempt_keys(events: Sequence[Event]) -> list[str]:
    keys: list[str] = []
    for e in of_kind(events, Started):
        if e.attempt and e.attempt not in keys:
            keys.append(e.attempt)
    return keys


def _group(events: Sequence[Event], keys: list[str]) -> dict[str, list[Stamped]]:
    """Each attempt's events that carry a time (``Stamped``: its ``ts`` known)."""
    out: dict[str, list[Stamped]] = {k: [] for k in keys}
    for e in events:
        if e.attempt in out and e.ts is not None:
            out[e.attempt].append(Stamped(e, float(e.ts)))
    return out


def _metrics_by_attempt(
    metrics: list[MetricsLine], by_attempt: dict[str, list[Stamped]], keys: list[str]
) -> dict[str, list[MetricsLine]]:
    """Lines per attempt: by their ``attempt`` key, else (older runs) by their ``ts``."""
    starts = [(min(s.ts for s in by_attempt[k]), k) for k in keys if by_attempt[k]]
    out: dict[str, list[MetricsLine]] = {}
    for line in metrics:
        if line.step is None:
            continue
        key = line.attempt
        if key not in by_attempt and line.ts is not None:
            ts = line.ts
            key = next((k for s, k in reversed(starts) if s <= ts), None)
        if key is not None and key in by_attempt:
            out.setdefault(key, []).append(line)
    return out


def _resumed_step(events: list[Stamped]) -> int | None:
    for s in events:
        if isinstance(s.event, Resumed):
            return s.event.step or 0
    return None


def _queue_from(submits: list[float], prev_end: float | None, events: list[Stamped]) -> float | None:
    """When this attempt began to wait: the latest submission or previous attempt's end before it."""
    started = _first(events, Started)
    if started is None:
        return None
    candidates = [t for t in submits if t <= started] + ([prev_end] if prev_end is not None else [])
    candidates = [t for t in candidates if t <= started]
    return max(candidates) if candidates else None


def _first(events: list[Stamped], kind: type[Event], *, node0: bool = False) -> float | None:
    for s in events:
        if isinstance(s.event, kind) and (not node0 or (s.event.node or 0) == 0):
            return s.ts
    return None


def _attempt_time(
    seen: _Evidence,
    *,
    time_limit_s: float | None,
    next_resume: int | None,
    live: bool,
    now: float,
    queue_from: float | None,
    prev_end: float | None,
) -> AttemptTime:
    a = AttemptTime(attempt=seen.attempt, running=live)
    events = seen.events
    started = _first(events, Started, node0=True)
    started = started if started is not None else _first(events, Started)
    started = started if started is not None else now
    alloc_start = _allocation_start(events, started, time_limit_s, prev_end)
    if queue_from is not None:
        queue_from = min(queue_from, alloc_start)  # `submit` records the job id after it has started
    alloc_end = _allocation_end(seen, live=live, now=now)
    alloc_end = max(alloc_end, alloc_start)
    resumed = next((s for s in events if isinstance(s.event, Resumed)), None)

    if resumed is not None:
        a.first_step = _resumed_step([resumed])
    points, note = _step_ends(resumed, seen, live=live, alloc_end=alloc_end)
    last_step, last_end = points[-1] if points else (None, None)
    if note:
        a.estimated.append(note)
    a.last_step = last_step

    saves = [s for s in events if isinstance(s.event, CheckpointSaved)]
    kept = max([_step(s) for s in saves] + [a.first_step or 0])
    if next_resume is not None and (a.first_step or 0) <= next_resume < kept:
        kept = next_resume  # the next attempt did not resume from this attempt's newest checkpoint
    elif next_resume is not None and kept < next_resume <= (last_step or 0):
        # the next attempt resumed from a state this one saved but never recorded (its ranks died
        # before they heard the background save end): those steps were kept
        kept = next_resume
    if last_step is not None:
        kept = last_step if live else min(kept, last_step)
    a.kept_step = kept if resumed is not None else None
    a.lost_steps = max(0, (last_step or 0) - kept) if resumed is not None else 0

    t_resumed = _clamp(resumed.ts if resumed else alloc_end, alloc_start, alloc_end)
    t_last = _clamp(last_end if last_end is not None else t_resumed, t_resumed, alloc_end)
    t_kept = _clamp(_time_of(points, kept) if points else t_resumed, t_resumed, t_last)
    # The saves' stalls that kept work; the one of the kept step itself comes right after it.
    stalls = _stalls(saves, points, last_step, kept, t_resumed, alloc_end, live=live)
    t_kept = max([t_kept, *(s.end for s in stalls)])
    t_last = max(t_last, t_kept)
    t_saved = _clamp(_end_save_time(events, last_step) or t_last, t_last, alloc_end)

    a.saves = len(stalls)
    a.stall_s = sum(s.end - s.start for s in stalls)
    a.startup_s = t_resumed - alloc_start
    a.training_s = max(0.0, t_kept - t_resumed - a.stall_s)
    a.lost_s = t_last - t_kept
    a.end_save_s = t_saved - t_last
    a.idle_s = alloc_end - t_saved
    a.allocated_s = alloc_end - alloc_start
    a.queue_s = alloc_start - queue_from if queue_from is not None else None
    a.goodput = a.training_s / a.allocated_s if a.allocated_s > 0 else None
    a.startup_parts = _startup_parts(events, alloc_start, started, t_resumed, resumed)

    a.segments = [Segment("queue", queue_from, alloc_start)] if queue_from is not None else []
    a.segments += [Segment("startup", alloc_start, t_resumed)]
    cursor = t_resumed
    for s in stalls:
        a.segments += [Segment("training", cursor, s.start), s]
        cursor = s.end
    a.segments += [
        Segment("training", cursor, t_kept),
        Segment("lost", t_kept, t_last),
        Segment("end_save", t_last, t_saved),
        Segment("idle", t_saved, alloc_end),
    ]
    a.segments = [s for s in a.segments if s.end > s.start or s.phase == "startup"]
    return a


def _step_ends(
    resumed: Stamped | None, seen: _Evidence, *, live: bool, alloc_end: float
) -> tuple[list[tuple[int, float]], str | None]:
    """(step, when it ended) from the resume and every metrics line; a crash's steps after its last
    line from rank 0's progress file, their time estimated (the note says so)."""
    lines, progress = seen.lines, seen.progress
    points: list[tuple[int, float]] = []
    if resumed is not None:
        points.append((_step(resumed), resumed.ts))
    for line in lines:
        if line.ts is not None and line.step is not None and (not points or line.step > points[-1][0]):
            points.append((line.step, line.ts))
    unlogged = None if live else _completed_step(progress, seen.events)
    if not points or unlogged is None or unlogged <= points[-1][0]:
        return points, None
    last_step, last_end = points[-1]
    step_time = _last_step_time(lines, progress) or 0.0
    points.append((unlogged, min(alloc_end, last_end + (unlogged - last_step) * step_time)))
    return (
        points,
        f"steps {last_step + 1}-{unlogged} were not logged; their time is estimated from the last step time",
    )


def _allocation_start(
    events: list[Stamped], started: float, time_limit_s: float | None, prev_end: float | None
) -> float:
    """The scheduler's start of the allocation, as the attempt's clock recorded it (older runs: its
    end time minus the limit), when that is sane (after the previous attempt's end, before the
    agent started, within 10 minutes of it)."""
    recorded = (
        allocation_start(s.event, limit_s=time_limit_s) for s in events if isinstance(s.event, Started)
    )
    start = next((t for t in recorded if t is not None), None)
    if start is None:
        return started
    floor = max(prev_end if prev_end is not None else 0.0, started - 600.0)
    return start if floor <= start <= started else started


def _allocation_end(seen: _Evidence, *, live: bool, now: float) -> float:
    events, lines, progress = seen.events, seen.lines, seen.progress
    ends = [s.ts for s in events if isinstance(s.event, _ATTEMPT_ENDS)]
    if ends:
        return max(ends)
    if live:
        return now
    # no end recorded (the agent itself was killed): the last sign of life
    stamps = [s.ts for s in events] + [x.ts for x in lines if x.ts is not None]
    if progress and progress.updated:
        stamps.append(progress.updated)
    return max(stamps) if stamps else now


def _last_step_time(lines: list[MetricsLine], progress: ProgressRecord | None) -> float | None:
    if progress and progress.last_step_s:
        return progress.last_step_s
    for line in reversed(lines):
        if line.step_time_s:
            return float(line.step_time_s)
    return None


def _completed_step(progress: ProgressRecord | None, events: list[Stamped]) -> int | None:
    """The last step the attempt completed: rank 0's progress record, or the step its decision
    recorded (the ranks' own count; rank 0 killed inside a step another rank completed has no
    record of that step), whichever is further (as ``status`` counts)."""
    steps = [progress.completed_step] if progress else []
    steps += [
        s.event.step for s in events if isinstance(s.event, (Requeued, Failed)) and s.event.step is not None
    ]
    return max(steps) if steps else None


def _time_of(points: list[tuple[int, float]], step: int) -> float:
    """When ``step`` ended: a known point, or linear inside the window that holds it."""
    for (s0, t0), (s1, t1) in itertools.pairwise(points):
        if s0 <= step <= s1:
            return t0 if s1 == s0 else t0 + (t1 - t0) * (step - s0) / (s1 - s0)
    return points[0][1] if step <= points[0][0] else points[-1][1]


def _end_save_time(events: list[Stamped], last_step: int | None) -> float | None:
    """When the stop or final save was published (the trainer records ``stopped`` after it)."""
    stamps = [s.ts for s in events if isinstance(s.event, Stopped)]
    stamps += [
        s.ts
        for s in events
        if isinstance(s.event, CheckpointSaved) and s.event.blocking and s.event.step == last_step
    ]
    return max(stamps) if stamps else None


def _stalls(
    saves: list[Stamped],
    points: list[tuple[int, float]],
    last_step: int | None,
    kept: int,
    t_resumed: float,
    t_end: float,
    *,
    live: bool,
) -> list[Segment]:
    """The blocking time of the periodic saves of steps up to ``kept``, right after their step."""
    out: list[Segment] = []
    for s in saves:
        e = s.event
        assert isinstance(e, CheckpointSaved)
        step = e.step or 0
        final = bool(e.blocking) and step == last_step and not live
        if final or step > kept or not points:
            continue
        stall = e.stall_s
        if stall is None:
            stall = e.seconds if e.blocking else 0.0
        start = _clamp(_time_of(points, step), t_resumed, t_end)
        end = _clamp(start + float(stall or 0.0), start, t_end)
        if end > start:
            out.append(Segment("stall", start, end))
    out.sort(key=lambda s: s.start)
    merged: list[Segment] = []
    for seg in out:  # two saves' stalls never overlap in time; clamp if timestamps say otherwise
        if merged and seg.start < merged[-1].end:
            seg = Segment("stall", merged[-1].end, max(merged[-1].end, seg.end))
        if seg.end > seg.start:
            merged.append(seg)
    return merged


def _startup_parts(
    events: list[Stamped],
    alloc_start: float,
    started: float,
    t_resumed: float,
    resumed: Stamped | None,
) -> dict[str, float]:
    """Where start-up went, as far as the ledger tells (the trainer's own parts when it reports them)."""
    parts: dict[str, float] = {}
    if started > alloc_start:
        parts["scheduler"] = started - alloc_start  # job script, agent process start
    checked = _first(events, NodePreflight, node0=True)
    cursor = started
    if checked is not None and started <= checked <= t_resumed:
        parts["node_checks"] = checked - started
        cursor = checked
    if resumed is None:
        parts["trainer"] = max(0.0, t_resumed - cursor)  # never got to train: what is known
        return parts
    assert isinstance(resumed.event, Resumed)
    process_start = resumed.event.process_start
    reported = resumed.event.startup_s
    if process_start is not None and cursor <= float(process_start) <= t_resumed:
        parts["launch"] = float(process_start) - cursor  # rank host, rendezvous of the agents, fork
        cursor = float(process_start)
    if reported:
        inside = 0.0
        for name in STARTUP_PARTS:
            value = reported.get(name)
            if isinstance(value, (int, float)) and value >= 0:
                parts[name] = float(value)
                inside += float(value)
        parts["other"] = max(0.0, t_resumed - cursor - inside)
    else:
        # launch, imports, rendezvous, smoke test, data check, model, checkpoint load
        parts["trainer"] = max(0.0, t_resumed - cursor)
    return parts


def _clamp(value: float, low: float, high: float) -> float:
    return min(max(value, low), high)


def _totals(attempts: list[AttemptTime]) -> RunTime:
    run = RunTime(attempts=attempts)
    for a in attempts:
        for key in ("allocated_s", *(f"{p}_s" for p in PHASES), "lost_steps"):
            setattr(run, key, getattr(run, key) + (getattr(a, key) or 0))
    run.goodput = run.training_s / run.allocated_s if run.allocated_s > 0 else None
    return run


def _rounded(obj: Any) -> Any:
    if isinstance(obj, float):
        return round(obj, 3)
    if isinstance(obj, dict):
        return {k: _rounded(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_rounded(v) for v in obj]
    return obj


def metrics_steps_by_attempt(metrics: list[MetricsLine]) -> dict[str, int]:
    """The highest step each attempt logged (a crash's unsaved steps included)."""
    out: dict[str, int] = {}
    for line in metrics:
        key, step = line.attempt, line.step
        if key and step is not None:
            out[key] = max(out.get(key, 0), step)
    return out


def fmt_seconds(seconds: float | None) -> str:
    """``42.0 s``, ``3 min 05 s``, ``2 h 04 min``: what a person reads at a glance."""
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{int(seconds // 60)} min {int(seconds % 60):02d} s"
    return f"{int(seconds // 3600)} h {int(seconds % 3600 // 60):02d} min"
