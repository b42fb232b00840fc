"""What ``status`` says about stragglers: the slowest rank now, and the ranks the watchdog reported.

Reads the per-rank step-time summaries (``RUN/steptimes/rank<r>.jsonl``, only their last lines) and
the ledger's ``straggler`` events (written by node 0's watchdog, ``jobs.straggler_tracker``). Own work per
step is compared, never wall time: the collectives make every rank's step as long as the slowest.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..fsutil import read_jsonl
from ..rundir import Event, RunPaths, of_kind
from ..rundir.events import Straggler
from ..rundir.progress_files import steptimes_dir

_TAIL_BYTES = 4096  # a few summaries: enough for each rank's latest


@dataclass(frozen=True)
class SlowestRank:
    """The rank with the most own work per step in the latest summary (figures as the rank wrote them)."""

    rank: int | None
    node: str | None
    attempt: str | None
    step: int | None
    work_s: float | None
    wait_s: float | None
    fastest_rank: int | None
    fastest_s: float | None
    ratio: float | None
    ranks: int
    basis: str | None


@dataclass(frozen=True)
class ReportedStraggler:
    """A rank node 0's watchdog reported as a straggler (its ``straggler`` event)."""

    attempt: str | None
    rank: int | None
    rank_node: str | None
    step: int | None
    work_s: float | None
    fastest_s: float | None
    ratio: float | None


@dataclass(frozen=True)
class StragglerSummary:
    slowest: SlowestRank | None
    reported: list[ReportedStraggler]


def straggler_summary(paths: RunPaths, events: Iterable[Event]) -> StragglerSummary:
    """The slowest rank now and the reported stragglers, for ``status`` (``asdict`` for ``--json``)."""
    reported = [
        ReportedStraggler(e.attempt, e.rank, e.rank_node, e.step, e.work_s, e.fastest_s, e.ratio)
        for e in of_kind(events, Straggler)
    ]
    return StragglerSummary(slowest_rank(paths), reported)


def slowest_rank(paths: RunPaths) -> SlowestRank | None:
    """The rank with the most own work per step in the latest summary every rank wrote."""
    latest = [
        line for line in (_last_line(p) for p in sorted(steptimes_dir(paths).glob("rank*.jsonl"))) if line
    ]
    if not latest:
        return None
    newest = max(latest, key=lambda line: float(line.get("ts") or 0))
    same = [
        line
        for line in latest
        if line.get("attempt") == newest.get("attempt") and isinstance(line.get("work_s"), (int, float))
    ]
    if not same:
        return None
    slow = max(same, key=lambda line: float(line["work_s"]))
    fast = min(same, key=lambda line: float(line["work_s"]))
    ratio = round(float(slow["work_s"]) / float(fast["work_s"]), 3) if fast["work_s"] else None
    return SlowestRank(
        rank=slow.get("rank"),
        node=slow.get("node"),
        attempt=slow.get("attempt"),
        step=slow.get("step"),
        work_s=slow.get("work_s"),
        wait_s=slow.get("wait_s"),
        fastest_rank=fast.get("rank"),
        fastest_s=fast.get("work_s"),
        ratio=ratio,
        ranks=len(same),
        basis=slow.get("basis"),
    )


def describe(summary: StragglerSummary | None) -> str | None:
    """One status line, or None when no rank has summarised a step yet."""
    if not summary:
        return None
    slow, reported = summary.slowest, summary.reported
    parts = []
    if slow:
        ratio = f", {slow.ratio:.2f}x the fastest (rank {slow.fastest_rank})" if slow.ratio else ""
        parts.append(
            f"slowest rank {slow.rank} on {slow.node}: {float(slow.work_s or 0.0) * 1000:.1f} ms own work "
            f"per step{ratio} at step {slow.step}"
        )
    if reported:
        names = ", ".join(
            f"rank {r.rank} on {r.rank_node}" + (f" ({r.ratio:.2f}x)" if r.ratio else "") for r in reported
        )
        parts.append(f"stragglers: {names}")
    elif slow:
        parts.append("no stragglers")
    return "; ".join(parts) or None


def work_per_step(paths: RunPaths) -> dict[int, list[tuple[int, float]]]:
    """Every rank's own work per step over the whole run, ``{rank: [(step, seconds), ...]}`` in
    step order (one summary per N steps; a torn line is skipped): the report's per-rank figure."""
    series: dict[int, list[tuple[int, float]]] = {}
    for path in sorted(steptimes_dir(paths).glob("rank*.jsonl")):
        for line in read_jsonl(path):
            rank, step, work = line.get("rank"), line.get("step"), line.get("work_s")
            if isinstance(rank, int) and isinstance(step, int) and isinstance(work, (int, float)):
                series.setdefault(rank, []).append((step, float(work)))
    return {rank: sorted(points) for rank, points in sorted(series.items())}


def _last_line(path: Path) -> dict[str, Any] | None:
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - _TAIL_BYTES))
            data = f.read()
    except OSError:
        return None
    for raw in reversed(data.splitlines()):
        try:
            obj = json.loads(raw)
        except ValueError:
            continue  # a torn last line, or the cut first one
        if isinstance(obj, dict):
            return obj
    return None
