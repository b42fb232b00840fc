"""The agent's stop relay: what the scheduler's signals mean, and passing them on to the ranks.

The agent starts its rank host with USR1/USR2/TERM/INT ignored, so a scheduler signal can never
kill the host and orphan the ranks. Signals reach the agent's ``SignalInbox`` instead (handlers only
record them); the agent's loop hands them to ``StopRelay.handle_signals``, which signals the worker
pids straight away, then asks the scheduler what a SIGTERM is (its time limit, a requeue/preemption
or a cancellation) and writes the cause into this attempt's relay request (``rundir.control``:
authoritative, and never the user's request). The relay comes first because that question can take
its whole timeout (30 s) when a preemption storm loads the controller, and the SIGKILL follows after
KillWait (30 s by default): the ranks start saving on any stop signal, and the cause is settled
before the decision reads it. At the job's end time the SIGTERM is the time limit, which the node
knows from its own clock: the ranks get the time-limit signal at once. Before it, a rank that checks
before the request is written records the signal's guess, "preemption" (a cancellation is the
agent's own fact, and both save and end the same way).

After the scheduler's SIGTERM its SIGKILL follows (SLURM's KillWait, PBS's kill_delay): when the
workers have not finished their stop save shortly before it, the deciding agent (``lead``: node 0's
at first, the role moves with the decider) ends them itself
(``cut_off_if_due``) so that it can still decide (continue from the last checkpoint) instead of
dying undecided.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable
from types import FrameType

from ..rundir import STOP_OVERDUE, STOP_REQUESTED
from ..rundir.cause import STOP_CODES, Cause
from ..rundir.control import write_relay_stop
from ..schedulers.protocol import at_time_limit
from .node_run import NodeRun

CUT_OFF_MARGIN_S = 4.0  # node 0 ends a stop that overruns this long before the scheduler's SIGKILL


class SignalInbox:
    """Signal handlers that only record what arrived; the agent's loop acts on it."""

    def __init__(self) -> None:
        self.received: list[tuple[int, float]] = []

    def install(self) -> None:
        for sig in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGINT, signal.SIGCONT):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.received.append((signum, time.time()))

    def take(self) -> list[tuple[int, float]]:
        taken, self.received = self.received[:], []
        return taken


class StopRelay:
    """One attempt's stop state on one node: the strongest cause heard, whether it was a cancel,
    and whether node 0 had to cut the stop short (``interrupted``: the decision's fact)."""

    def __init__(self, node: NodeRun) -> None:
        self.node = node
        self.inbox = SignalInbox()
        # The ranks of the running attempt (the rank host's forkserver children), and how to end
        # them all at once on a second Ctrl-C; set by the agent while an attempt runs.
        self.ranks: Callable[[], list[int]] = list
        self.escalate: Callable[[], None] | None = None
        self.attempt = node.attempt  # the attempt whose ranks the relay speaks to
        self.stop_cause: Cause | None = None
        self.cancelled = False
        self.cut_off_at: float | None = None
        self.interrupted: Cause | None = None
        self.lead = node.ctx.is_head  # this agent decides: it cuts an overrunning stop save off

    def install(self) -> None:
        self.inbox.install()

    def next_attempt(self, node: NodeRun) -> None:
        """A new attempt in the same allocation: what was relayed belonged to the last one. A
        cancellation stays: the job itself is going away."""
        self.node = node
        self.attempt, self.stop_cause, self.cut_off_at, self.interrupted = node.attempt, None, None, None

    def handle_signals(self) -> None:
        for signum, at in self.inbox.take():
            if signum == signal.SIGCONT:
                continue  # SLURM sends CONT before TERM/USR*; nothing to do
            if signum == signal.SIGTERM:
                # Before the scheduler is asked (see above). At the job's end time it is the time
                # limit, which this node knows without asking: the ranks hear it as one.
                at_limit = at_time_limit(self.node.ctx, at)
                self._signal_workers(signal.SIGUSR1 if at_limit else signal.SIGTERM)
            cause, relay = self._classify(signum, at)
            if cause is None:
                continue
            current = self.stop_cause
            first = current is None
            strongest = cause if current is None or STOP_CODES[cause] > STOP_CODES[current] else current
            self.stop_cause = strongest
            if strongest is not Cause.USER:  # Ctrl-C: the ranks see SIGINT themselves
                write_relay_stop(
                    self.node.paths, self.attempt, strongest, by=f"agent:{signal.Signals(signum).name}"
                )
            if first or signum == signal.SIGTERM:
                self.node.ledger.append(
                    STOP_REQUESTED,
                    cause=Cause.CANCELLED if self.cancelled else strongest,
                    source=signal.Signals(signum).name,
                )
            if signum != signal.SIGTERM:
                self._signal_workers(relay)
            if signum == signal.SIGINT and not first:
                self._escalate()

    def cut_off_if_due(self, now: float) -> None:
        if self.cut_off_at is not None and now >= self.cut_off_at and self.interrupted is None:
            self._cut_short()

    def _cut_short(self) -> None:
        """The scheduler's kill is seconds away and the workers are still at it: end them now."""
        self.interrupted = Cause.PREEMPTION if self.stop_cause is Cause.PREEMPTION else Cause.TIMEOUT
        self.node.ledger.append(
            STOP_OVERDUE,
            cause=self.interrupted,
            reason="the stop save did not finish before the scheduler's kill; the workers were ended",
        )
        for pid in self.worker_pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def _classify(self, signum: int, at: float) -> tuple[Cause | None, int]:
        if signum in (signal.SIGUSR1, signal.SIGUSR2):
            return Cause.TIMEOUT, signal.SIGUSR1
        if signum == signal.SIGINT:
            return Cause.USER, signal.SIGINT
        if signum == signal.SIGTERM:
            # Only the scheduler knows whether a SIGTERM is its time limit, a requeue or a
            # cancellation (a warning before it proves nothing: `scancel` may follow a warning).
            what = self.node.scheduler.termination_cause(self.node.paths, self.node.ctx, now=at)
            if self.cut_off_at is None and self.lead:
                self.cut_off_at = at + max(
                    1.0, self.node.scheduler.kill_grace_s(self.node.plan) - CUT_OFF_MARGIN_S
                )
            if what is Cause.CANCELLED:
                self.cancelled = True
                return Cause.PREEMPTION, signal.SIGTERM  # save now; the decision will not continue
            if what is Cause.TIMEOUT:
                return Cause.TIMEOUT, signal.SIGUSR1
            return Cause.PREEMPTION, signal.SIGTERM
        return None, 0

    def worker_pids(self) -> list[int]:
        """The ranks (their DataLoader workers are theirs to end)."""
        return self.ranks()

    def _signal_workers(self, signum: int) -> None:
        for pid in self.worker_pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    def _escalate(self) -> None:
        """Second Ctrl-C: stop waiting for the save; the ranks are ended."""
        if self.escalate is not None:
            self.escalate()
