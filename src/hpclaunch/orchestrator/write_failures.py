"""What a run failed to write and trained on without: its failed saves and its experiment logs
(W&B, TensorBoard) that failed or went offline, from the ledger, and their status lines."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..rundir import Event, of_kind
from ..rundir.events import CheckpointFailed, ExperimentLogFailed

__all__ = [
    "ExperimentLogFailure",
    "FailedSave",
    "FailedSaves",
    "describe_experiment_logs",
    "describe_failed_saves",
    "experiment_log_failures",
    "failed_saves",
]


@dataclass(frozen=True)
class FailedSave:
    """The newest save that failed, and what the trainer did about it."""

    attempt: str | None
    step: int | None
    error: str | None
    action: str | None


@dataclass(frozen=True)
class FailedSaves:
    count: int
    last: FailedSave


@dataclass(frozen=True)
class ExperimentLogFailure:
    """W&B or TensorBoard failed (or W&B went offline) and training went on."""

    log: str | None
    attempt: str | None
    error: str | None
    action: str | None


def failed_saves(events: Sequence[Event]) -> FailedSaves | None:
    """The saves that failed (None: none did): how many, and the newest with what was done."""
    failed = of_kind(events, CheckpointFailed)
    if not failed:
        return None
    last = failed[-1]
    return FailedSaves(len(failed), FailedSave(last.attempt, last.step, last.error, last.action))


def describe_failed_saves(summary: FailedSaves | None) -> str | None:
    """One status line, or None when no save failed."""
    if not summary:
        return None
    last, n = summary.last, summary.count
    what = "1 save failed" if n == 1 else f"{n} saves failed"
    action = f" ({last.action})" if last.action else ""
    return f"checkpoint: {what}; the last at step {last.step}{action}: {last.error}"


def experiment_log_failures(events: Sequence[Event]) -> list[ExperimentLogFailure]:
    """Every time W&B or TensorBoard failed and training went on without it (or W&B offline)."""
    return [
        ExperimentLogFailure(e.log, e.attempt, e.error, e.action)
        for e in of_kind(events, ExperimentLogFailed)
    ]


def describe_experiment_logs(failures: list[ExperimentLogFailure] | None) -> list[str]:
    """Status lines: the newest failure of each log (W&B offline, a log dropped)."""
    newest = {f.log: f for f in failures or []}
    return [f"{log}: {f.error} in attempt {f.attempt}; {f.action}" for log, f in newest.items()]
