"""When the memory tier snapshots, and what a snapshot costs training (torch-free).

Cost. A snapshot's *whole cost* is what the training loop waited for (its stall: the state dict and
the staging layout after the step; the staging copies at the next update, inside that step) plus
the slowdown of the steps its job ran beside (the job's CPU: copies, checksum, gloo's transport,
competing with training). The stall alone hides most of it on a busy node. Each rank measures its
own (``CostMeter``): the loop's period from one ``after_step`` to the next, against the median of
the periods with no job in flight.

Interval. ``checkpoint.memory.every_steps: N`` snapshots every N steps; ``auto`` at the interval
that loses the least expected time, as the disk tier's saves (``checkpoint.save_interval``: Young/Daly,
sqrt(2 x C x M)), with C the measured whole cost and M the run's MTBF (``checkpoint.mtbf_hours`` per
node over the nodes, pooled with the failures the ledger has seen). Every rank must snapshot at the
same steps (each one's buddy waits for it), so rank 0 decides and every rank adopts its decision at
the snapshot steps themselves, which all ranks pass together: the attempt's first snapshot at its
``CALIBRATION_STEPS``-th step (to measure), the next ``PROBE_STEPS`` later (the first one's cost is
known by then), then each at the interval decided at the one before.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from typing import Any, TypedDict

from ..checkpoint.save_interval import (
    CALIBRATION_STEPS,
    expected_loss_per_failure_s,
    expected_waste_share,
    young_daly_interval_s,
)

PROBE_STEPS = 10  # auto: steps from the attempt's first snapshot to its second (the first's cost measured)
_RECENT = 32  # steady periods the step time is the median of
_COSTS = 3  # whole costs averaged


class CostMeter:
    """One rank's measure of its snapshots' whole cost (see the module docstring)."""

    def __init__(self) -> None:
        self._steady: list[float] = []
        self._periods = 0
        self._start: float | None = None
        self._beside = False
        self._excess = 0.0
        self._costs: list[float] = []

    @property
    def step_s(self) -> float | None:
        """The median loop period with no snapshot job in flight (the attempt's first is warm-up)."""
        recent = self._steady[-_RECENT:]
        return statistics.median(recent) if recent else None

    @property
    def cost_s(self) -> float | None:
        """The whole cost of the last few snapshots, averaged."""
        return sum(self._costs) / len(self._costs) if self._costs else None

    def period_ended(self, now: float) -> None:
        if self._start is None:
            return
        dt, self._start = now - self._start, None
        self._periods += 1
        if self._beside:
            base = self.step_s
            self._excess += max(0.0, dt - base) if base is not None else 0.0
        elif self._periods > 1:
            self._steady.append(dt)
            del self._steady[:-_RECENT]

    def period_begins(self, now: float, *, job_in_flight: bool) -> None:
        self._start, self._beside = now, job_in_flight

    def job_started(self) -> None:
        self._excess = 0.0

    def job_settled(self, stall_s: float) -> tuple[float, float]:
        """(the slowdown of the steps beside the job, the whole cost) of the job just settled."""
        whole = stall_s + self._excess
        self._costs.append(whole)
        del self._costs[:-_COSTS]
        return self._excess, whole


class SnapshotDecision(TypedDict):
    """Rank 0's choice of the next snapshot (``auto``), broadcast and recorded as ``snapshot_interval``."""

    step: int
    next_step: int
    interval_steps: int
    interval_s: float | None
    step_time_s: float | None
    whole_cost_s: float | None
    mtbf_s: float
    expected_loss_per_failure_s: float | None
    expected_waste_share: float | None


class SnapshotSchedule:
    """Which steps snapshot: every ``every`` steps, or (``every`` None: auto) those rank 0 decides."""

    def __init__(self, every: int | None, *, mtbf_s: float, start_step: int) -> None:
        self.every = every
        self.mtbf_s = mtbf_s
        self.next_step = start_step + CALIBRATION_STEPS
        self._decided = 0

    @property
    def auto(self) -> bool:
        return self.every is None

    def due(self, step: int) -> bool:
        if self.every is not None:
            return step % self.every == 0
        return step >= self.next_step

    def postpone(self, step: int) -> None:
        """A due step that a disk save takes (every rank knows it): the next step instead."""
        if self.auto:
            self.next_step = step + 1

    def propose(self, step: int, meter: CostMeter) -> SnapshotDecision:
        """Rank 0, at a due step: the next snapshot and the figures behind it."""
        cost, step_s = meter.cost_s, meter.step_s
        interval_s: float | None = None
        if cost is None or not step_s:
            interval_steps = PROBE_STEPS  # nothing measured yet: measure this one first
        else:
            interval_s = young_daly_interval_s(cost, self.mtbf_s)
            interval_steps = max(1, round(interval_s / step_s))
        self._decided += 1
        return {
            "step": step,
            "next_step": step + interval_steps,
            "interval_steps": interval_steps,
            "interval_s": _round(interval_s),
            "step_time_s": _round(step_s, 5),
            "whole_cost_s": _round(cost, 5),
            "mtbf_s": round(self.mtbf_s, 1),
            "expected_loss_per_failure_s": _round(
                expected_loss_per_failure_s(interval_s) if interval_s else None
            ),
            "expected_waste_share": _round(
                expected_waste_share(interval_s, cost, self.mtbf_s)
                if interval_s and cost is not None
                else None,
                6,
            ),
        }

    def adopt(self, decision: Mapping[str, Any]) -> None:
        self.next_step = int(decision["next_step"])


def _round(x: float | None, digits: int = 3) -> float | None:
    return round(x, digits) if x is not None else None
