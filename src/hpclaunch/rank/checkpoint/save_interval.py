"""When to save: every N steps, every N minutes, or at the interval that loses the least expected time.

The rule (``checkpoint.every_steps: auto``). A periodic save costs the training it takes: C seconds,
measured, its blocking part plus the slowdown of the steps its writer runs beside. A failure,
expected every M seconds, loses the work since the last save: T/2 on average with a save every T
seconds. Over one failure the expected waste is W(T) = M*C/T + T/2 (the saves paid for between two
failures, plus the half interval lost), smallest at T* = sqrt(2*C*M) (Young 1974; Daly 2006 to
first order), where W(T*) = T*: per failure, half an interval of work is lost (T*/2), and the
saves between two failures cost as much again. ``status`` shows the loss per failure and the share
of training the saves and failures take, W(T)/M. M is ``checkpoint.mtbf_hours`` per node divided by the node count,
corrected by what this run's ledger has seen: M = (prior + seconds trained) / (1 + failures), the
configured figure counting as one failure's worth of evidence.

Agreement. The interval decides at which step every rank saves, so it is identical everywhere: rank
0 proposes (from its own step times and measured save cost) and every rank adopts what rank 0
broadcasts, at points all ranks pass together: a calibration step early in each attempt, and the
step at which a periodic save settles. Timing never changes the math: a save copies the state, and
training goes on bitwise the same whatever the interval.

Bounded by the run. The run's last step saves anyway (the final save), so an interval that would
reach past it (a short run, a long MTBF: Young/Daly's hour against a minute of training) becomes
"no periodic save before the end", and the figures are those of the interval as bounded: a failure
then loses at most what is left of the run. The decision says so (``bounded_by``). Torch-free.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypedDict

from ...rundir.events import Event
from ...rundir.kinds import FINISHED, RESUMED, STOPPED

Mode = Literal["steps", "auto", "minutes"]
CALIBRATION_STEPS = 5  # steps of an attempt measured before its first decision (the first is warm-up)
_RECENT = 32  # step times the baseline is the median of
_COSTS = 3  # measured save costs averaged


def young_daly_interval_s(save_cost_s: float, mtbf_s: float) -> float:
    """The save interval that minimizes the expected time lost: sqrt(2 x save cost x MTBF)."""
    return math.sqrt(2.0 * save_cost_s * mtbf_s)


def expected_loss_per_failure_s(interval_s: float) -> float:
    """Training one failure is expected to lose at saves every ``interval_s``: the work since the
    last save, half an interval on average (computed again after the restart)."""
    return interval_s / 2.0


def expected_waste_share(interval_s: float, save_cost_s: float, mtbf_s: float) -> float:
    """The share of training time the saves and the failures are expected to take together:
    W(T) / M = C/T + T/(2M) (the saves' cost per interval, plus a failure's loss per MTBF)."""
    return save_cost_s / interval_s + interval_s / (2.0 * mtbf_s)


def run_mtbf_s(mtbf_hours_per_node: float, nodes: int, *, failures: int, trained_s: float) -> float:
    """The run's mean time between failures: the configured per-node figure over ``nodes``, as one
    failure's worth of prior evidence, pooled with the failures seen in ``trained_s`` of this run."""
    prior = mtbf_hours_per_node * 3600.0 / max(nodes, 1)
    return (prior + max(trained_s, 0.0)) / (1 + max(failures, 0))


@dataclass(frozen=True)
class Policy:
    mode: Mode
    every_steps: int | None  # mode "steps"
    every_minutes: float | None  # mode "minutes"
    mtbf_s: float  # the run's, ledger included
    last_step: int | None = None  # the run's last step (train.steps): its final save bounds the interval


class IntervalDecision(TypedDict):
    """Rank 0's choice of the next save and the figures behind it: broadcast to every rank and
    appended to the ledger as ``checkpoint_interval`` (``rundir.events.CheckpointInterval``)."""

    step: int
    mode: str
    next_step: int
    interval_steps: int
    interval_s: float | None
    step_time_s: float | None
    save_cost_s: float | None
    mtbf_s: float | None
    expected_loss_per_failure_s: float | None
    expected_waste_share: float | None
    save_stall_s: float | None  # the blocking part of save_cost_s (the rest: steps slowed beside it)
    bounded_by: str | None  # "run end": the interval chosen reached past the run's last step
    unbounded_interval_s: float | None  # the interval before it was bounded


class SaveSchedule:
    """Which steps save (``due``), with what each rank measures and what rank 0 decides (see module)."""

    def __init__(self, policy: Policy, *, start_step: int) -> None:
        self.policy = policy
        self.start_step = start_step
        self.next_step: int | None = None  # modes auto/minutes: the agreed step of the next save
        self.interval_steps: int | None = policy.every_steps
        self._steady: list[float] = []  # step times with no save in flight
        self._seen_steps = 0
        self._stall = 0.0
        self._excess = 0.0
        self._costs: list[float] = []
        self._stalls: list[float] = []
        self._last_save_step: int | None = None

    @property
    def save_cost_s(self) -> float | None:
        """The training a periodic save took, averaged over the last few measured."""
        return sum(self._costs) / len(self._costs) if self._costs else None

    @property
    def step_time_s(self) -> float | None:
        recent = self._steady[-_RECENT:]
        return statistics.median(recent) if recent else None

    # ---- measurements (every rank; only rank 0's decide) ----------------------------------------

    def observe(self, step_s: float, *, saving: bool) -> None:
        """One step's time; ``saving``: a background save was in flight during it."""
        self._seen_steps += 1
        if saving:
            base = self.step_time_s
            self._excess += max(0.0, step_s - base) if base is not None else 0.0
        elif self._seen_steps > 1:  # the attempt's first step is warm-up
            self._steady.append(step_s)
            del self._steady[:-_RECENT]

    def save_started(self, step: int, stall_s: float) -> None:
        self._last_save_step = step
        self._stall, self._excess = stall_s, 0.0
        if self.policy.mode != "steps":
            self.next_step = None  # the next save is decided when this one has settled

    def save_settled(self) -> None:
        """The save started last has ended on every rank: its cost is known."""
        self._costs.append(self._stall + self._excess)
        self._stalls.append(self._stall)
        del self._costs[:-_COSTS], self._stalls[:-_COSTS]

    # ---- decisions --------------------------------------------------------------------------

    def due(self, step: int) -> bool:
        if self.policy.mode == "steps":
            assert self.policy.every_steps is not None
            return step % self.policy.every_steps == 0
        return self.next_step is not None and step >= self.next_step

    def calibrating(self, step: int) -> bool:
        """The attempt's first decision is due at this step (all ranks know the start step)."""
        return step == self.start_step + CALIBRATION_STEPS

    def propose(self, step: int) -> IntervalDecision:
        """Rank 0: the next save and the figures behind it (JSON, for the broadcast and the ledger)."""
        p, cost, step_s = self.policy, self.save_cost_s, self.step_time_s
        interval_s: float | None
        if p.mode == "steps":
            interval_steps = p.every_steps or 1
            interval_s = interval_steps * step_s if step_s else None
        elif p.mode == "minutes":
            interval_s = (p.every_minutes or 0.0) * 60.0
            interval_steps = _steps(interval_s, step_s)
        elif cost is None:  # auto, nothing measured yet: save now, and measure that save
            interval_s, interval_steps = None, 0
        else:
            interval_s = young_daly_interval_s(cost, p.mtbf_s)
            interval_steps = _steps(interval_s, step_s)
        base = self._last_save_step if self._last_save_step is not None else self.start_step
        next_step = step if interval_steps == 0 else max(base + interval_steps, step + 1)
        bounded_by, unbounded_s = None, None
        if p.mode != "steps" and p.last_step is not None and interval_steps and next_step >= p.last_step:
            # The final save comes first: no periodic save before it, and what a failure can lose
            # is what is left of the run, not an interval it never reaches.
            bounded_by, unbounded_s = "run end", _round(interval_s)
            interval_steps = max(1, p.last_step - base)
            interval_s = interval_steps * step_s if step_s else None
            next_step = p.last_step + 1
        interval_s = _round(interval_s)  # what the ledger keeps: `status` derives the loss from it
        loss = expected_loss_per_failure_s(interval_s) if interval_s else None
        waste = expected_waste_share(interval_s, cost, p.mtbf_s) if interval_s and cost is not None else None
        return {
            "step": step,
            "mode": p.mode,
            "next_step": next_step,
            "interval_steps": interval_steps,
            "interval_s": _round(interval_s),
            "step_time_s": _round(step_s, 4),
            "save_cost_s": _round(cost, 4),
            "mtbf_s": _round(p.mtbf_s, 4),
            "expected_loss_per_failure_s": _round(loss),
            "expected_waste_share": _round(waste, 6),
            "save_stall_s": _round(sum(self._stalls) / len(self._stalls), 4) if self._stalls else None,
            "bounded_by": bounded_by,
            "unbounded_interval_s": unbounded_s,
        }

    def adopt(self, decision: Mapping[str, Any]) -> None:
        """Every rank: the decision rank 0 broadcast (an ``IntervalDecision``, as JSON)."""
        if self.policy.mode != "steps":
            self.next_step = int(decision["next_step"])
            self.interval_steps = int(decision["interval_steps"])


def _steps(interval_s: float, step_s: float | None) -> int:
    """Whole steps in ``interval_s`` (at least one)."""
    if not step_s:
        return 1
    return max(1, round(interval_s / step_s))


def _round(x: float | None, digits: int = 3) -> float | None:
    return round(x, digits) if x is not None else None


def policy_from_config(
    every_steps: int | str,
    every_minutes: float | None,
    mtbf_hours: float,
    nodes: int,
    *,
    failures: int,
    trained_s: float,
    last_step: int | None = None,
) -> Policy:
    mtbf = run_mtbf_s(mtbf_hours, nodes, failures=failures, trained_s=trained_s)
    if every_minutes is not None:
        return Policy("minutes", None, every_minutes, mtbf, last_step)
    if every_steps == "auto":
        return Policy("auto", None, None, mtbf, last_step)
    return Policy("steps", int(every_steps), None, mtbf, last_step)


def ledger_failures(events: Sequence[Event], *, current_attempt: str | None) -> tuple[int, float]:
    """(failures, seconds trained) of this run's earlier attempts, from the ledger: an attempt whose
    trainer resumed and that ended without ``stopped`` or ``finished`` (a crash, a kill, a hang, a
    lost node) is a failure. Its training time runs from ``resumed`` to its last event. Reads event
    names only, never causes."""
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    stopped: set[str] = set()
    for e in events:
        attempt, ts = e.attempt, e.ts
        if attempt is None or ts is None or attempt == current_attempt:
            continue
        if e.event == RESUMED and attempt not in first:
            first[attempt] = float(ts)
        if e.event in (STOPPED, FINISHED):
            stopped.add(attempt)
        last[attempt] = max(last.get(attempt, float(ts)), float(ts))
    failures = sum(1 for a in first if a not in stopped and a in last)
    trained = sum(last[a] - first[a] for a in first)
    return failures, trained
