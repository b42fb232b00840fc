"""What ``status`` and ``report`` say of the memory tier (``checkpoint.memory``): whether it is on and
how, what it kept, what it could not (the first failure of each rank and attempt, as the ranks said
it), and, beside each attempt's steps, which tier that attempt resumed from (``steps_text``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..rundir import RunPaths
from ..rundir.events import Event, Resumed, SnapshotFailed, SnapshotSaved, of_kind


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
    failures: list[SnapshotFailure] = field(default_factory=list)
    fallbacks: list[tuple[str, str]] = field(default_factory=list)  # (attempt, why the disk served)

    @property
    def on(self) -> bool:
        return self.every_steps is not None


def memory_tier_view(paths: RunPaths, events: Sequence[Event]) -> MemoryTierView:
    memory = _configured(paths)
    if memory.get("every_steps") is None:
        return MemoryTierView(None)
    return MemoryTierView(
        memory.get("every_steps"),
        memory.get("keep_last"),
        memory.get("replicas"),
        saved=len(of_kind(events, SnapshotSaved)),
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
    lines = [
        f"memory tier: on, a snapshot every {view.every_steps} steps (keep {view.keep_last}{copies}); "
        f"{view.saved} complete"
    ]
    if view.failures:
        f = view.failures[0]
        where = f"rank {f.rank} on {f.node}" if f.rank is not None else "a rank"
        more = f" (and {len(view.failures) - 1} more rank(s) or attempts)" if len(view.failures) > 1 else ""
        lines.append(f"memory tier: {where} in attempt {f.attempt}: {f.error}{more}")
    for attempt, why in view.fallbacks[-1:]:
        lines.append(f"memory tier: attempt {attempt} resumed from the disk: {why}")
    return lines


def _configured(paths: RunPaths) -> dict[str, Any]:
    import yaml

    try:
        data = yaml.safe_load(paths.config.read_text()) or {}
        memory = data.get("checkpoint", {}).get("memory") or {}
    except (OSError, AttributeError, yaml.YAMLError):
        return {}
    return memory if isinstance(memory, dict) else {}
