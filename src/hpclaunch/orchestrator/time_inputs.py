"""What the time accounting reads from a run directory: the merged ledger, metrics.jsonl, rank 0's
progress file per attempt and the plan's time limit (``accounting.account`` does the arithmetic)."""

from __future__ import annotations

from pathlib import Path

from ..rundir import Event, RunPaths, read_events
from ..rundir.metrics import MetricsLine, read_metrics
from ..rundir.plan_reader import read_plan_view
from ..rundir.progress_files import ProgressRecord, read_progress
from .accounting import RunTime, account, attempt_keys


def read_rank0_progress(paths: RunPaths, attempt: str) -> ProgressRecord | None:
    """Rank 0's last progress record of ``attempt`` (its node agent's file, or its own)."""
    return read_progress(paths, attempt).get(0)


def time_limit_of(paths: RunPaths) -> float | None:
    """The limit the scheduler applies to each attempt; None without a plan that states one."""
    plan = read_plan_view(paths)
    return plan.applied_limit_s if plan is not None else None


def run_time(
    run: Path,
    *,
    events: list[Event] | None = None,
    metrics: list[MetricsLine] | None = None,
    live: bool = False,
    now: float | None = None,
) -> RunTime:
    """``account()`` of the run directory ``run`` (events and metrics may be passed in when read)."""
    paths = RunPaths(run)
    events = read_events(paths).events if events is None else events
    metrics = read_metrics(paths.metrics) if metrics is None else metrics
    progress = {k: p for k in attempt_keys(events) if (p := read_rank0_progress(paths, k)) is not None}
    return account(events, metrics, time_limit_s=time_limit_of(paths), progress=progress, live=live, now=now)
