"""How one attempt ended: ``RUN/attempts/<attempt>.json``, written by the trainer's rank 0 and read
by the node agent (to decide what happens next) and by ``status``.

``status``: finished (every step done), stopped (all ranks saved after the same step, for
``cause``), failed (``cause`` says whose verdict: ``training`` and ``data`` are the run's own and
never retried; ``crash``, ``filesystem`` and ``hang`` are the machine's). After a clean stop every
rank exits 0 (torch's elastic launcher treats a non-zero exit as a crash), so this file, not an
exit code, carries the story. A missing file means the trainer never got to write one: a crash.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from ..fsutil import atomic_write_json
from .cause import Cause, UnknownCause
from .paths import RunPaths
from .progress_files import furthest_completed_step, read_progress

Status = Literal["finished", "stopped", "failed"]


@dataclass
class AttemptOutcome:
    status: Status
    cause: Cause | None = None
    step: int | None = None
    error: str | None = None
    world_size: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # params hash, per-rank summaries, ...

    def __post_init__(self) -> None:
        self.cause = Cause.parse_optional(self.cause)

    def to_json(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "cause": self.cause.value if self.cause is not None else None,
            "step": self.step,
            "error": self.error,
            "world_size": self.world_size,
            **self.extra,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> AttemptOutcome:
        known = {"status", "cause", "step", "error", "world_size"}
        status = data.get("status")
        return cls(
            status=status if status in ("finished", "stopped", "failed") else "failed",
            cause=Cause.parse_optional(data.get("cause")),
            step=data.get("step"),
            error=data.get("error"),
            world_size=data.get("world_size"),
            extra={k: v for k, v in data.items() if k not in known},
        )


def write_outcome(paths: RunPaths, attempt: str, outcome: AttemptOutcome) -> None:
    atomic_write_json(paths.outcome_file(attempt), outcome.to_json())


def read_outcome(paths: RunPaths, attempt: str) -> AttemptOutcome | None:
    """The outcome the trainer wrote for ``attempt``; None when it wrote none, or wrote one that is
    not an outcome (torn JSON, a cause nobody defined). ``OSError`` other than a missing file is
    raised: "cannot read now" is not "no outcome" (the caller retries, see ``read_outcome_retrying``)."""
    try:
        data = json.loads(paths.outcome_file(attempt).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    try:
        return AttemptOutcome.from_json(data) if isinstance(data, dict) else None
    except UnknownCause:
        return None


def write_rank_outcome(paths: RunPaths, attempt: str, rank: int, outcome: AttemptOutcome) -> None:
    atomic_write_json(paths.rank_outcome_file(attempt, rank), outcome.to_json())


def attempt_outcome(paths: RunPaths, attempt: str) -> AttemptOutcome | None:
    """How ``attempt`` ended: rank 0's outcome, unless rank 0 only saw the others go (none, or a
    crash) while another rank said why it failed on its own (a bad batch, its own error): that
    rank's verdict, the run's own failure first."""
    main = read_outcome(paths, attempt)
    if main is not None and not (main.status == "failed" and main.cause is Cause.CRASH):
        return main
    others = []
    for path in sorted(paths.attempt_dir(attempt).glob("rank*.outcome.json")):
        try:
            data = json.loads(path.read_text())
            if isinstance(data, dict):
                others.append(AttemptOutcome.from_json(data))
        except (FileNotFoundError, json.JSONDecodeError, UnknownCause):
            continue
    own = [o for o in others if o.cause is not None and o.cause.is_own_failure]
    return own[0] if own else (main or (others[0] if others else None))


def latest_outcome(paths: RunPaths) -> AttemptOutcome | None:
    """The most recently written outcome of the run (the foreground ``train`` command's verdict)."""
    files = (
        sorted(paths.attempts.glob("*.json"), key=lambda p: p.stat().st_mtime)
        if paths.attempts.is_dir()
        else []
    )
    for path in reversed(files):
        try:
            data = json.loads(path.read_text())
            if isinstance(data, dict):
                return AttemptOutcome.from_json(data)
        except (OSError, json.JSONDecodeError, UnknownCause):
            continue
    return None


def reached_step(paths: RunPaths, attempt: str, outcome: AttemptOutcome | None) -> int | None:
    """The step ``attempt`` reached, recorded with its decision. A finish or a stop: the outcome's
    (every rank agreed on it). A failure, or no outcome (a hang, every rank killed, a node gone): the
    furthest of the outcome's and the step the ranks' heartbeats say one of them completed (a rank
    stopped by its launcher may report less than another finished); one read of the nodes'
    aggregates, only then. None when neither is known."""
    if outcome is not None and outcome.status != "failed" and outcome.step is not None:
        return outcome.step
    steps = [outcome.step] if outcome is not None and outcome.step is not None else []
    try:
        furthest = furthest_completed_step(read_progress(paths, attempt))
    except OSError:
        furthest = None
    steps += [furthest] if furthest is not None else []
    return max(steps) if steps else None
