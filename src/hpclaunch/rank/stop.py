"""The stop protocol: every rank stops after the same step, for one named cause.

Sources only *set a flag*; nothing here does I/O or collectives inside a signal handler:

- a signal received by this worker: SIGUSR1/SIGUSR2 (the scheduler's warning before the end),
  SIGTERM (preemption, ``scontrol requeue``, the time limit itself), SIGINT (Ctrl-C);
- the stop requests (``rundir.control``): the user's, and the node agent's relay of the scheduler's
  signal for this attempt; read by rank 0 at check steps;
- the deadline: the attempt clock's end minus the stop lead (``rundir.clock``: one rule, fed with
  the slowest save measured so far and the current step time and check interval).

Every ``k`` steps all ranks ``all_reduce(MAX)`` a small CPU tensor ``[request cause, signal cause,
deadline cause, k proposal]`` on a gloo group, so one rank that heard a signal stops all of them
after the same step, all ranks agree on the cause (a request first: whoever wrote it knew why),
and all agree on the next ``k``. ``k`` is chosen so the check costs under 1 % of step time while
keeping the reaction time under ``max_reaction_s``. Whether the run then ends or continues is not
this protocol's business: the node agent's decision reads the user's request itself.
"""

from __future__ import annotations

import math
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any

from ..rundir import RunPaths
from ..rundir.cause import STOP_BY_CODE, STOP_CODES, Cause
from ..rundir.clock import AttemptClock
from ..rundir.control import relay_stop, user_stop

# What a signal means when it reaches a worker directly. The agent's relay request carries the
# authoritative cause; these are the fallbacks when the signal arrives first.
SIGNAL_CAUSES: dict[int, Cause] = {
    signal.SIGUSR1: Cause.TIMEOUT,
    signal.SIGUSR2: Cause.TIMEOUT,
    signal.SIGTERM: Cause.PREEMPTION,
    signal.SIGINT: Cause.USER,
}


def _code(cause: Cause | None) -> int:
    return STOP_CODES.get(cause, 0) if cause is not None else 0


@dataclass(frozen=True)
class StopGroup:
    """The ranks that stop together: this one's rank (rank 0 reads the stop requests), their number
    and the gloo group they agree on (None with one rank)."""

    rank: int = 0
    world_size: int = 1
    group: Any = None


class StopController:
    """Decides, identically on every rank, whether to stop after the current step.

    ``check(step, step_time_s)`` must be called by every rank after every optimizer step; it only
    communicates on check steps. ``paths``/``attempt``: where rank 0 reads the stop requests (None:
    no requests). ``ranks``: who agrees (one rank alone by default). ``clock``: the attempt's clock
    (None: no deadline).
    """

    def __init__(
        self,
        *,
        paths: RunPaths | None,
        attempt: str | None = None,
        ranks: StopGroup = StopGroup(),
        clock: AttemptClock | None = None,
        max_reaction_s: float = 2.0,
        now: Callable[[], float] = time.time,
    ):
        self.paths = paths
        self.attempt = attempt
        self.rank, self.world_size, self.group = ranks.rank, ranks.world_size, ranks.group
        self.clock = clock
        self.max_reaction_s = max_reaction_s
        self.now = now
        self.k = 1
        self.next_check = 1
        self.signal_cause: Cause | None = None
        self.signals_seen: list[str] = []
        self.check_cost_s = 0.0
        self.checks = 0
        self.save_s: float | None = None  # the slowest save measured (decaying), None before one
        self._step_time_s = 0.0
        self._prev_handlers: dict[int, Any] = {}

    def join(self, ranks: StopGroup) -> None:
        """The ranks that agree from now on (a rank learns them when its script joins its group)."""
        self.rank, self.world_size, self.group = ranks.rank, ranks.world_size, ranks.group

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
        self.request(SIGNAL_CAUSES.get(signum, Cause.USER))
        self.signals_seen.append(signal.Signals(signum).name)

    def request(self, cause: Cause) -> None:
        """Local programmatic request (tests, the trainer itself); the stronger cause is kept."""
        if _code(cause) > _code(self.signal_cause):
            self.signal_cause = cause

    def note_checkpoint_seconds(self, seconds: float) -> None:
        """A measured save time; the deadline keeps room for the slowest one seen."""
        self.save_s = seconds if self.save_s is None else max(seconds, 0.5 * self.save_s)

    @property
    def lead_s(self) -> float | None:
        """Seconds before the attempt's end at which the run stops to save (None: no clock)."""
        if self.clock is None:
            return None
        return self.clock.stop_lead(save_s=self.save_s, step_s=self._step_time_s, check_every=self.k)

    def lead_fields(self) -> dict[str, float | None]:
        """For the ``stopped`` event: the lead in force and the measured save it kept room for
        (``save_s`` None: the plan's estimate, no save measured in this attempt yet)."""
        lead = self.lead_s
        return {
            "lead_s": None if lead is None else round(lead, 3),
            "save_s": None if self.save_s is None else round(self.save_s, 3),
        }

    def _local_causes(self) -> list[int]:
        """[requests, signal, deadline] as seen by this rank."""
        requested = 0
        if self.rank == 0 and self.paths is not None:
            user = user_stop(self.paths)
            relay = relay_stop(self.paths, self.attempt) if self.attempt else None
            requested = max(_code(r.cause) for r in (user, relay) if r is not None) if user or relay else 0
        deadline = 0
        lead = self.lead_s
        if lead is not None and self.clock is not None and self.now() >= self.clock.end - lead:
            deadline = _code(Cause.TIMEOUT)
        return [requested, _code(self.signal_cause), deadline]

    # ---- the collective check -----------------------------------------------------------------

    def check(self, step: int, step_time_s: float) -> Cause | None:
        """None, or the cause every rank stops for after ``step`` (same answer on all ranks)."""
        if step_time_s > 0:
            a = 0.1 if self._step_time_s else 1.0
            self._step_time_s = (1 - a) * self._step_time_s + a * step_time_s
        if step < self.next_check:
            return None
        agreed = self._agree([*self._local_causes(), self._propose_k()])
        self.k = max(1, agreed[-1])
        self.next_check = step + self.k
        # A request is authoritative: the agent that relayed it knew why (a worker that only saw
        # SIGTERM guesses "preemption"). Then signals, then the deadline.
        for code in agreed[:-1]:
            if code:
                return STOP_BY_CODE[code]
        return None

    def check_at(self, step: int) -> None:
        """Agree at ``step`` whatever the interval says (every rank must call it for the same step:
        the check is a collective)."""
        self.next_check = min(self.next_check, step)

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
