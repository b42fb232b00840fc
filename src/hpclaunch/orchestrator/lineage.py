"""What ``status`` shows of a run's lineage: the chain it belongs to (``submit --after``) and where
its first weights came from (``train.init_from``). Reads run directories only; never imports torch."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..rundir import Event, RunPaths, of_kind, read_events
from ..rundir.chain import (
    MAX_PASSES,
    SettleFailures,
    Settlement,
    failures,
    followers,
    predecessor,
    settlement,
    verdict,
)
from ..rundir.events import Initialized


@dataclass(frozen=True)
class ChainPredecessor:
    """The run this one waits for (``submit --after``): its state now and what was done."""

    run: str
    state: str
    job_id: str | None
    outcome: str  # waiting | retrying | blocked | released | cancelled
    reason: str | None


@dataclass(frozen=True)
class ChainFollower:
    """A run waiting for this one, and what was done about it."""

    run: str
    job_id: str
    outcome: str
    reason: str | None


@dataclass(frozen=True)
class ChainView:
    after: ChainPredecessor | None
    next: list[ChainFollower]

    def to_json(self) -> dict[str, Any]:
        """``{"after": {...}, "next": [...]}``, each key only where it has something."""
        out: dict[str, Any] = {}
        if self.after is not None:
            out["after"] = asdict(self.after)
        if self.next:
            out["next"] = [asdict(f) for f in self.next]
        return out


@dataclass(frozen=True)
class WeightsSource:
    """Where the run's first weights came from (the trainer's ``initialized`` event)."""

    checkpoint: str | None
    run: str | None
    step: int | None
    ema: bool
    source_world_size: int | None
    source_parallel: str | None


def chain_view(paths: RunPaths) -> ChainView | None:
    """The chain a run is in, else None.

    after: the run this one waits for, its state now, and what was done (released / cancelled, why,
    by whom) or ``waiting``; next: every run waiting for this one, with the same.
    """
    after_view = None
    before = predecessor(paths)
    if before is not None:
        after = RunPaths(Path(before.run))
        v = verdict(read_events(after).events, after.root) if after.is_run() else None
        done = settlement(paths, str(before.job_id))
        failed = failures(paths, str(before.job_id))
        after_view = ChainPredecessor(
            run=str(after.root),
            state=v.state if v is not None else "missing",
            job_id=before.job_id,
            outcome=_outcome(done, failed),
            reason=_reason(done, failed) or (v.reason if v is not None else f"{after.root} is gone"),
        )
    nxt = []
    for f in followers(paths):
        done = settlement(RunPaths(f.run), f.job_id)
        failed = failures(RunPaths(f.run), f.job_id)
        nxt.append(
            ChainFollower(
                run=str(f.run),
                job_id=f.job_id,
                outcome=_outcome(done, failed),
                reason=_reason(done, failed),
            )
        )
    if after_view is None and not nxt:
        return None
    return ChainView(after_view, nxt)


def _outcome(settled: Settlement | None, failed: SettleFailures | None = None) -> str:
    if settled is None:
        # A release or cancel that failed: tried again by a later pass (never by status), up to
        # MAX_PASSES; then blocked, for a person to release.
        if failed is None:
            return "waiting"
        return "retrying" if failed.tries < MAX_PASSES else "blocked"
    return "released" if settled.action == "release" else "cancelled"


def _by_hand(job_id: str | None) -> str:
    return f"release job {job_id} by hand (scontrol release {job_id}; PBS: qrls {job_id})"


def _reason(settled: Settlement | None, failed: SettleFailures | None) -> str | None:
    """Why it was released or cancelled, else the last error of a try that failed."""
    return (settled.reason if settled else None) or (failed.error if failed else None)


def weights_from(events: Sequence[Event]) -> WeightsSource | None:
    """Where the run's first weights came from (the trainer's ``initialized`` event), else None."""
    found = of_kind(events, Initialized)
    if not found:
        return None
    e = found[-1]
    return WeightsSource(
        checkpoint=e.checkpoint,
        run=e.run,
        step=e.step,
        ema=bool(e.ema),
        source_world_size=e.source_world_size,
        source_parallel=e.source_parallel,
    )


def describe_chain(chain: ChainView | None) -> list[str]:
    """The status lines of a chain, in words."""
    if not chain:
        return []
    lines = []
    after = chain.after
    if after:
        if after.outcome == "waiting":
            lines.append(f"chain: waits for {after.run} ({after.state}): starts when it finishes")
        elif after.outcome in ("retrying", "blocked"):
            again = (
                "tried again by the next cancel or submit --after, or " if after.outcome == "retrying" else ""
            )
            lines.append(
                f"chain: after {after.run}: {after.reason}; still held: {again}{_by_hand(after.job_id)}"
            )
        elif after.outcome == "released":
            lines.append(f"chain: after {after.run}: released ({after.reason})")
        else:
            lines.append(f"chain: after {after.run}: never runs ({after.reason})")
    for n in chain.next:
        what = {
            "waiting": "waits for this run",
            "released": "released",
            "cancelled": "cancelled",
            "retrying": "still held, tried again by the next cancel or submit --after",
            "blocked": f"still held: {_by_hand(n.job_id)}",
        }[n.outcome]
        why = f" ({n.reason})" if n.reason and n.outcome != "waiting" else ""
        lines.append(f"chain: next {n.run} (job {n.job_id}): {what}{why}")
    return lines


def describe_weights(source: WeightsSource | None) -> str | None:
    if not source:
        return None
    what = "EMA weights" if source.ema else "weights"
    where = source.run or source.checkpoint
    return f"weights: started from the {what} of {where} step {source.step} ({source.checkpoint})"
