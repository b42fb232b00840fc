"""The attempt's clock: when the allocation started and ends, and the one rule for how long before
the end a run stops to save.

Built once per attempt by the scheduler module from the scheduler's own facts (``node_context``),
recorded whole in the ``started`` event and handed to every rank in ``HPCLAUNCH_ATTEMPT_CLOCK``;
the stop controller, the script lint, preflight and the time accounting all read it, so a change to
the rule changes every place that checks it.

- ``attempt_end``: the one end-time computation (the scheduler's own end where it states one,
  SLURM's ``EndTime``; else start + limit).
- ``stop_lead_s``: the one stop-lead rule. ``launch.stop_lead_s`` when set; else room for one save
  (1.5x its time: the slowest seen, or the plan's estimate before any save was measured), for the
  steps until the next stop check, and ``launch.stop_margin_s``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from .env import CLOCK_VAR
from .events import Started

SAVE_SLACK = 1.5  # a save may run slower than the slowest one measured (a busier filesystem)


def whole_minutes(limit_s: float) -> int:
    """The limit as SLURM takes it: whole minutes, rounded up so a run never gets less than asked."""
    return max(1, math.ceil(limit_s / 60))


def applied_limit_s(scheduler: str | None, limit_s: float) -> float:
    """The limit ``scheduler`` applies to each attempt of a run that asked for ``limit_s``: SLURM
    counts whole minutes (``whole_minutes``), the others take the seconds as given."""
    return whole_minutes(limit_s) * 60.0 if scheduler == "slurm" else float(limit_s)


def attempt_end(*, start: float, limit_s: float, scheduler_end: float | None = None) -> float:
    """When the scheduler ends an attempt: its own end where it states one, else start + limit."""
    return float(scheduler_end) if scheduler_end is not None else float(start) + float(limit_s)


def stop_lead_s(
    *, fixed_s: float | None, save_s: float, margin_s: float, step_s: float = 0.0, check_every: int = 1
) -> float:
    """Seconds before the end at which every rank must stop to save in time (see module doc)."""
    if fixed_s is not None:
        return float(fixed_s)
    return SAVE_SLACK * save_s + max(1, check_every) * max(0.0, step_s) + margin_s


@dataclass(frozen=True)
class AttemptClock:
    """One attempt's time, as its scheduler states it (all times are ``time.time()`` values)."""

    start: float  # the allocation's start
    end: float  # when the scheduler ends the attempt
    limit_s: float  # the time limit the scheduler applies (SLURM: whole minutes)
    warn_lead_s: float  # when before the end the scheduler warns (SLURM --signal, the local USR2)
    stop_lead_fixed_s: float | None  # launch.stop_lead_s; None = the rule with measured save times
    margin_s: float  # launch.stop_margin_s
    save_estimate_s: float  # one save, as planned, until a save of this run is measured

    @classmethod
    def build(
        cls,
        *,
        start: float,
        limit_s: float,
        scheduler_end: float | None,
        warn_lead_s: float,
        stop_lead_fixed_s: float | None,
        margin_s: float,
        save_estimate_s: float,
    ) -> AttemptClock:
        end = attempt_end(start=start, limit_s=limit_s, scheduler_end=scheduler_end)
        return cls(
            start=float(start),
            end=end,
            limit_s=float(limit_s),
            warn_lead_s=float(warn_lead_s),
            stop_lead_fixed_s=None if stop_lead_fixed_s is None else float(stop_lead_fixed_s),
            margin_s=float(margin_s),
            save_estimate_s=float(save_estimate_s),
        )

    def stop_lead(self, *, save_s: float | None = None, step_s: float = 0.0, check_every: int = 1) -> float:
        """``stop_lead_s`` for this attempt (``save_s``: the slowest measured save, if any)."""
        return stop_lead_s(
            fixed_s=self.stop_lead_fixed_s,
            save_s=self.save_estimate_s if save_s is None else save_s,
            margin_s=self.margin_s,
            step_s=step_s,
            check_every=check_every,
        )

    def deadline(self, *, save_s: float | None = None, step_s: float = 0.0, check_every: int = 1) -> float:
        """The time at which the run must stop to save before ``end``."""
        return self.end - self.stop_lead(save_s=save_s, step_s=step_s, check_every=check_every)

    # ---- recorded form: the `started` event and the ranks' environment --------------------------

    def to_json(self) -> dict[str, float | None]:  # every field is seconds or a time
        return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in asdict(self).items()}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> AttemptClock:
        fixed = data.get("stop_lead_fixed_s")
        return cls(
            start=float(data["start"]),
            end=float(data["end"]),
            limit_s=float(data["limit_s"]),
            warn_lead_s=float(data.get("warn_lead_s", 0)),
            stop_lead_fixed_s=None if fixed is None else float(fixed),
            margin_s=float(data.get("margin_s", 0)),
            save_estimate_s=float(data.get("save_estimate_s", 0)),
        )

    def to_env(self) -> dict[str, str]:
        return {CLOCK_VAR: json.dumps(self.to_json(), sort_keys=True)}

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> AttemptClock | None:
        """The clock the node agent handed to the ranks; None without one (no deadline)."""
        text = environ.get(CLOCK_VAR)
        if not text:
            return None
        return cls.from_json(json.loads(text))


def allocation_start(started: Started, *, limit_s: float | None) -> float | None:
    """When an attempt's allocation started, from its ``started`` event: the recorded clock; for
    runs written before the clock was recorded, their end time minus ``limit_s`` (the limit the
    scheduler applied). None when the event says neither."""
    clock = started.clock
    if clock is not None and clock.get("start") is not None:
        return float(clock["start"] or 0)
    end = started.end_time
    if end is None or not limit_s:
        return None
    return float(end) - float(limit_s)
