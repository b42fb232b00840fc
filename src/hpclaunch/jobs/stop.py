"""The stop protocol: every rank stops after the same step, for one named cause.

Sources only *set a flag*; nothing here does I/O or collectives inside a signal handler:

- a signal received by this worker: SIGUSR1/SIGUSR2 (the scheduler's warning before the end),
  SIGTERM (preemption, ``scontrol requeue``, the time limit itself), SIGINT (Ctrl-C);
- the control file ``RUN/control/stop`` (written by ``hpclaunch stop``, by the node agent when it
  gets the scheduler's warning, by the batch shell's trap); polled by rank 0 at check steps;
- the deadline: the job's end time minus the time a checkpoint takes (measured) minus a margin.

Every ``k`` steps all ranks ``all_reduce(MAX)`` a small CPU tensor ``[file cause, signal cause,
deadline cause, k proposal]`` on a gloo group, so one rank that heard a signal stops all of them
after the same step, all ranks agree on the cause (control file first: whoever wrote it knew why),
and all agree on the next ``k``. ``k`` is chosen so the check costs under 1 % of step time while keeping the
reaction time under ``max_reaction_s``.
"""

from __future__ import annotations

import json
import math
import signal
import time
from collections.abc import Callable
from enum import IntEnum
from pathlib import Path
from types import FrameType
from typing import Any


class StopCause(IntEnum):
    """Why a run stops early. Larger wins when several sources fire at once."""

    NONE = 0
    USER = 1
    TIMEOUT = 2
    PREEMPTION = 3

    @property
    def label(self) -> str:
        return self.name.lower()

    @classmethod
    def from_label(cls, label: str) -> StopCause:
        try:
            return cls[label.strip().upper()]
        except KeyError:
            return cls.USER


# What a signal means when it reaches a worker directly. The agent writes the authoritative cause
# into the control file; these are the fallbacks when the signal arrives first.
SIGNAL_CAUSES: dict[int, StopCause] = {
    signal.SIGUSR1: StopCause.TIMEOUT,
    signal.SIGUSR2: StopCause.TIMEOUT,
    signal.SIGTERM: StopCause.PREEMPTION,
    signal.SIGINT: StopCause.USER,
}


def write_stop_request(stop_file: Path, cause: StopCause | str, *, by: str) -> None:
    """Ask every rank of the running attempt to stop and save (atomic; safe to call repeatedly)."""
    from ..fsutil import atomic_write_json

    label = cause.label if isinstance(cause, StopCause) else str(cause)
    atomic_write_json(stop_file, {"cause": label, "by": by, "requested_at": time.time()})


def read_stop_request(stop_file: Path) -> StopCause:
    """The cause written in the control file, NONE when there is none (a torn file counts as user)."""
    try:
        text = stop_file.read_text()
    except FileNotFoundError:
        return StopCause.NONE
    try:
        data = json.loads(text)
        return StopCause.from_label(str(data.get("cause", "user")))
    except (json.JSONDecodeError, AttributeError):
        return StopCause.USER


class StopController:
    """Decides, identically on every rank, whether to stop after the current step.

    ``check(step, step_time_s)`` must be called by every rank after every optimizer step; it only
    communicates on check steps. ``end_time`` is an absolute ``time.time()`` value (None = no limit).
    """

    def __init__(
        self,
        *,
        stop_file: Path | None,
        rank: int = 0,
        world_size: int = 1,
        group: Any = None,
        end_time: float | None = None,
        stop_lead_s: float | None = None,
        margin_s: float = 10.0,
        checkpoint_s_estimate: float = 5.0,
        max_reaction_s: float = 2.0,
        clock: Callable[[], float] = time.time,
    ):
        self.stop_file = stop_file
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.end_time = end_time
        self.stop_lead_s = stop_lead_s
        self.margin_s = margin_s
        self.checkpoint_s = checkpoint_s_estimate
        self.max_reaction_s = max_reaction_s
        self.clock = clock
        self.k = 1
        self.next_check = 1
        self.signal_cause = StopCause.NONE
        self.signals_seen: list[str] = []
        self.check_cost_s = 0.0
        self.checks = 0
        self._step_time_s = 0.0
        self._prev_handlers: dict[int, Any] = {}

    # ---- sources ------------------------------------------------------------------------------

    def install_signal_handlers(self, signals: tuple[int, ...] = tuple(SIGNAL_CAUSES)) -> None:
        for sig in signals:
            self._prev_handlers[sig] = signal.signal(sig, self._on_signal)

    def restore_signal_handlers(self) -> None:
        for sig, handler in self._prev_handlers.items():
            signal.signal(sig, handler)
        self._prev_handlers.clear()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Only flags: no I/O, no collectives, no allocation-heavy work in a handler.
        cause = SIGNAL_CAUSES.get(signum, StopCause.USER)
        if cause > self.signal_cause:
            self.signal_cause = cause
        self.signals_seen.append(signal.Signals(signum).name)

    def request(self, cause: StopCause) -> None:
        """Local programmatic request (tests, the trainer itself)."""
        if cause > self.signal_cause:
            self.signal_cause = cause

    def note_checkpoint_seconds(self, seconds: float) -> None:
        """A measured save time; the deadline keeps room for the slowest one seen."""
        self.checkpoint_s = max(seconds, 0.5 * self.checkpoint_s)

    @property
    def lead_s(self) -> float:
        """Seconds before ``end_time`` at which the run must stop to save in time."""
        if self.stop_lead_s is not None:
            return float(self.stop_lead_s)
        # Room for the save (with slack), the steps until the next check, and a margin.
        return 1.5 * self.checkpoint_s + self.k * self._step_time_s + self.margin_s

    def _local_causes(self) -> list[int]:
        """[control file, signal, deadline] as seen by this rank."""
        from_file = StopCause.NONE
        if self.rank == 0 and self.stop_file is not None:
            from_file = read_stop_request(self.stop_file)
        deadline = StopCause.NONE
        if self.end_time is not None and self.clock() >= self.end_time - self.lead_s:
            deadline = StopCause.TIMEOUT
        return [int(from_file), int(self.signal_cause), int(deadline)]

    # ---- the collective check -----------------------------------------------------------------

    def check(self, step: int, step_time_s: float) -> StopCause:
        """NONE, or the cause every rank stops for after ``step`` (same answer on all ranks)."""
        if step_time_s > 0:
            a = 0.1 if self._step_time_s else 1.0
            self._step_time_s = (1 - a) * self._step_time_s + a * step_time_s
        if step < self.next_check:
            return StopCause.NONE
        agreed = self._agree([*self._local_causes(), self._propose_k()])
        self.k = max(1, agreed[-1])
        self.next_check = step + self.k
        # The control file is authoritative: the agent that wrote it knew why (a worker that only
        # saw SIGTERM guesses "preemption"). Then signals, then the deadline.
        for cause in agreed[:-1]:
            if cause:
                return StopCause(cause)
        return StopCause.NONE

    def _propose_k(self) -> int:
        s = self._step_time_s
        if s <= 0:
            return 1
        k_cost = math.ceil(self.check_cost_s / (0.01 * s)) if self.check_cost_s > 0 else 1
        k_react = max(1, math.floor(self.max_reaction_s / s))
        return max(1, min(k_cost, k_react))

    def _agree(self, values: list[int]) -> list[int]:
        """Element-wise MAX over all ranks (one tiny CPU all_reduce on a gloo group)."""
        if self.world_size <= 1:
            return values
        import torch
        import torch.distributed as dist

        t0 = time.perf_counter()
        flags = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        cost = time.perf_counter() - t0
        self.checks += 1
        self.check_cost_s = cost if self.checks == 1 else 0.9 * self.check_cost_s + 0.1 * cost
        return [int(v) for v in flags.tolist()]
