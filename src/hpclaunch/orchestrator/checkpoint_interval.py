"""The save interval the trainer chose last (its ``checkpoint_interval`` events), for ``status``.

Rank 0 of the trainer records, after every save and at the calibration step of an attempt, the
interval it chose and the figures behind it (``rank.checkpoint.save_interval``): the measured cost of
a save (the training it took), the step time, the run's MTBF, and the training a failure is
expected to lose at that interval (half of it), and the share of training time that saves and
failures take together. Torch-free.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..rundir.events import CheckpointInterval, Event, of_kind


@dataclass(frozen=True)
class IntervalSummary:
    """The trainer's last decision, as ``status`` shows it (its ``--json`` is ``asdict``)."""

    attempt: str | None
    step: int | None
    mode: str | None
    interval_steps: int | None
    interval_s: float | None
    next_step: int | None
    save_cost_s: float | None
    step_time_s: float | None
    mtbf_s: float | None
    expected_loss_per_failure_s: float | None
    expected_waste_share: float | None
    save_stall_s: float | None = None  # the blocking part of save_cost_s (None: not recorded)
    bounded_by: str | None = None  # "run end": the interval chosen reached past the run's last step
    unbounded_interval_s: float | None = None


def checkpoint_interval_summary(events: Sequence[Event]) -> IntervalSummary | None:
    """The last decision, or None when the trainer has made none (older runs, short attempts)."""
    decisions = of_kind(events, CheckpointInterval)
    if not decisions:
        return None
    last = decisions[-1]
    # Derived from the interval, not taken as recorded: ledgers before issue 26 recorded the whole
    # waste over one MTBF under "expected_loss_per_failure_s".
    interval, cost, mtbf = last.interval_s, last.save_cost_s, last.mtbf_s
    return IntervalSummary(
        attempt=last.attempt,
        step=last.step,
        mode=last.mode,
        interval_steps=last.interval_steps,
        interval_s=interval,
        next_step=last.next_step,
        save_cost_s=cost,
        step_time_s=last.step_time_s,
        mtbf_s=mtbf,
        expected_loss_per_failure_s=round(interval / 2.0, 3) if interval else None,
        expected_waste_share=(
            round(cost / interval + interval / (2.0 * mtbf), 6)
            if interval and cost is not None and mtbf
            else None
        ),
        save_stall_s=last.save_stall_s,
        bounded_by=last.bounded_by,
        unbounded_interval_s=last.unbounded_interval_s,
    )


def describe(summary: IntervalSummary | None) -> str | None:
    """One line for ``status``: the interval and what a failure is expected to cost at it."""
    if not summary:
        return None
    how = {
        "auto": "auto, Young/Daly",
        "minutes": "checkpoint.every_minutes",
        "steps": "checkpoint.every_steps",
    }
    mode = how.get(str(summary.mode), str(summary.mode))
    if not summary.interval_steps:
        return f"checkpoints: saving once to measure what a save costs ({mode})"
    if summary.bounded_by == "run end":
        text = "checkpoints: no periodic save before the run's last step (its final save keeps it)"
        if summary.unbounded_interval_s is not None:
            text += f"; Young/Daly's ~{_duration(summary.unbounded_interval_s)} is longer than the run"
        text += f"; {summary.interval_steps} steps"
    else:
        text = f"checkpoints: every {summary.interval_steps} steps"
    if summary.interval_s is not None:
        text += f" (~{_duration(summary.interval_s)})"
    figures = [mode]
    if summary.save_cost_s is not None:
        figures.append(f"a save costs {summary.save_cost_s:.3f} s of training{_split(summary)}")
    if summary.mtbf_s is not None:
        figures.append(f"MTBF {_duration(summary.mtbf_s)}")
    text += f" [{'; '.join(figures)}]"
    if summary.expected_loss_per_failure_s is not None:
        text += (
            f"; a failure is expected to lose ~{_duration(summary.expected_loss_per_failure_s)} of training"
        )
    if summary.expected_waste_share is not None:
        text += f"; saves and failures together ~{summary.expected_waste_share:.2%} of training time"
    return text


def _split(summary: IntervalSummary) -> str:
    """Where a save's cost went: the loop's stall (status's stall column) and the steps its
    background writer slowed (counted there as training)."""
    stall, cost = summary.save_stall_s, summary.save_cost_s
    if stall is None or cost is None:
        return ""
    return f": {stall:.3f} s stalled + {max(0.0, cost - stall):.3f} s of steps slowed beside its writer"


# Above this share of training, saves cost more than they are worth: say what would.
COSTLY_SHARE = 0.25


def advice(summary: IntervalSummary | None) -> str | None:
    """What to change when a fixed interval's saves take a large share of training (None: nothing)."""
    if not summary or summary.expected_waste_share is None or summary.expected_waste_share <= COSTLY_SHARE:
        return None
    cost, mtbf, step_s = summary.save_cost_s, summary.mtbf_s, summary.step_time_s
    if summary.mode in ("steps", "minutes") and cost and mtbf and step_s:
        best = max(1, round(math.sqrt(2.0 * cost * mtbf) / step_s))
        return (
            f"hint: saves cost more training than failures are expected to lose; save less often: "
            f"checkpoint.every_steps: auto (here ~every {best} steps) or a larger every_steps"
        )
    return None  # auto chose the least waste there is for this save cost and MTBF


def _duration(seconds: float) -> str:
    s = float(seconds)
    if s < 120:
        return f"{s:.1f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.1f} h"
