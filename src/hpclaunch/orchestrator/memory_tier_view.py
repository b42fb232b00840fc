"""What ``status`` and ``report`` say of the memory tier (``checkpoint.memory``): whether it is on and
how, what it kept, what it could not (the first failure of each rank and attempt, as the ranks said
it), and, beside each attempt's steps, which tier that attempt resumed from (``steps_text``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..rundir import RunPaths
from ..rundir.events import Event, Resumed, SnapshotFailed, SnapshotInterval, SnapshotSaved, of_kind


@dataclass(frozen=True)
class SnapshotFailure:
    attempt: str | None
    rank: int | None
    node: str | None
    step: int | None
    error: str | None


@dataclass(frozen=True)
class MemoryTierView:
    """The tier as configured, and what the ledger says it did."""

    every_steps: int | str | None  # None: off
    keep_last: int | None = None
    replicas: int | None = None
    saved: int = 0  # snapshots rank 0 saw complete
    whole_s: float | None = None  # their mean whole cost (stall + the slowdown beside the job)
    stall_s: float | None = None  # their mean stall
    auto: dict[str, Any] | None = None  # the last ``snapshot_interval`` (every_steps: auto)
    failures: list[SnapshotFailure] = field(default_factory=list)
    fallbacks: list[tuple[str, str]] = field(default_factory=list)  # (attempt, why the disk served)

    @property
    def on(self) -> bool:
        return self.every_steps is not None


def memory_tier_view(paths: RunPaths, events: Sequence[Event]) -> MemoryTierView:
    memory = _configured(paths)
    if memory.get("every_steps") is None:
        return MemoryTierView(None)
    saved = of_kind(events, SnapshotSaved)
    decided = of_kind(events, SnapshotInterval)
    return MemoryTierView(
        memory.get("every_steps"),
        memory.get("keep_last"),
        memory.get("replicas"),
        saved=len(saved),
        whole_s=_mean([e.whole_s for e in saved]),
        stall_s=_mean([e.stall_s for e in saved]),
        auto=dict(decided[-1].record) if decided else None,
        failures=[
            SnapshotFailure(e.attempt, e.rank, e.node_name, e.step, e.error)
            for e in of_kind(events, SnapshotFailed)
        ],
        fallbacks=[
            (e.attempt or "?", e.memory_reason)
            for e in of_kind(events, Resumed)
            if e.tier == "disk" and e.memory_reason
        ],
    )


def describe_memory_tier(view: MemoryTierView | None) -> list[str]:
    """Status lines when the tier is on: how, what it kept, its first failure, the last fallback."""
    if view is None or not view.on:
        return []
    copies = "" if not view.replicas else f", {view.replicas} copy on the next node"
    every = f"every {view.every_steps} steps"
    if view.auto is not None:
        every = f"every {view.auto.get('interval_steps')} steps (auto{_why(view.auto)})"
    elif view.every_steps == "auto":
        every = "at an interval still to be measured (auto)"
    cost = ""
    if view.whole_s is not None:
        cost = f", each costing training {view.whole_s * 1000:.1f} ms ({(view.stall_s or 0) * 1000:.1f} ms stalled)"
    lines = [
        f"memory tier: on, a snapshot {every}, keep {view.keep_last}{copies}; {view.saved} complete{cost}"
    ]
    if view.failures:
        f = view.failures[0]
        where = f"rank {f.rank} on {f.node}" if f.rank is not None else "a rank"
        more = f" (and {len(view.failures) - 1} more rank(s) or attempts)" if len(view.failures) > 1 else ""
        lines.append(f"memory tier: {where} in attempt {f.attempt}: {f.error}{more}")
    for attempt, why in view.fallbacks[-1:]:
        lines.append(f"memory tier: attempt {attempt} resumed from the disk: {why}")
    return lines


def _why(decision: dict[str, Any]) -> str:
    cost, mtbf = decision.get("whole_cost_s"), decision.get("mtbf_s")
    if cost is None or mtbf is None:
        return ": measuring a snapshot's cost"
    return f": whole cost {cost * 1000:.1f} ms, MTBF {mtbf / 3600:.3g} h"


def _mean(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None


def _configured(paths: RunPaths) -> dict[str, Any]:
    import yaml

    try:
        data = yaml.safe_load(paths.config.read_text()) or {}
        memory = data.get("checkpoint", {}).get("memory") or {}
    except (OSError, AttributeError, yaml.YAMLError):
        return {}
    return memory if isinstance(memory, dict) else {}
