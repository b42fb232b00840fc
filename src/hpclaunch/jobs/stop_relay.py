"""The agent's stop relay: what the scheduler's signals mean, and passing them on to the ranks.

The agent starts torchrun with USR1/USR2/TERM/INT ignored, so a scheduler signal can never kill
torchrun and orphan the workers. Signals reach the agent's ``SignalInbox`` instead (handlers only
record them); the agent's loop hands them to ``StopRelay.handle_signals``, which asks the scheduler
what a SIGTERM is (its time limit, a requeue/preemption or a cancellation), writes the cause into
the control file (authoritative) and signals the worker pids straight away.

After the scheduler's SIGTERM its SIGKILL follows (SLURM's KillWait, PBS's kill_delay): when the
workers have not finished their stop save shortly before it, node 0 ends them itself
(``cut_off_if_due``) so that it can still decide (continue from the last checkpoint) instead of
dying undecided.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from types import FrameType

from ..rundir import STOP_OVERDUE, STOP_REQUESTED, JobPlan, Ledger, RunPaths
from ..schedulers.base import NodeContext, Scheduler
from .stop import StopCause, read_stop_request, write_stop_request

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


def ignored_signals_preexec() -> None:
    """Runs in torchrun's process before exec: ignored dispositions survive exec (and reach the
    workers, which install their own handlers)."""
    for sig in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)


class StopRelay:
    """One attempt's stop state on one node: the strongest cause heard, whether it was a cancel,
    and whether node 0 had to cut the stop short (``interrupted``: the decision's fact)."""

    def __init__(
        self, paths: RunPaths, plan: JobPlan, ctx: NodeContext, scheduler: Scheduler, ledger: Ledger
    ) -> None:
        self.paths = paths
        self.plan = plan
        self.ctx = ctx
        self.scheduler = scheduler
        self.ledger = ledger
        self.inbox = SignalInbox()
        self.proc: subprocess.Popen[bytes] | None = None  # torchrun, once started
        self.stop_cause: StopCause = StopCause.NONE
        self.cancelled = False
        self.cut_off_at: float | None = None
        self.interrupted: str | None = None

    def install(self) -> None:
        self.inbox.install()

    def handle_signals(self) -> None:
        for signum, at in self.inbox.take():
            if signum == signal.SIGCONT:
                continue  # SLURM sends CONT before TERM/USR*; nothing to do
            cause, relay = self._classify(signum, at)
            if cause == StopCause.NONE:
                continue
            first = self.stop_cause == StopCause.NONE
            self.stop_cause = max(self.stop_cause, cause)
            if self.ctx.is_head or read_stop_request(self.paths.stop_file) == StopCause.NONE:
                write_stop_request(
                    self.paths.stop_file, self.stop_cause, by=f"agent:{signal.Signals(signum).name}"
                )
            if first or signum == signal.SIGTERM:
                self.ledger.append(
                    STOP_REQUESTED,
                    cause="cancelled" if self.cancelled else self.stop_cause.label,
                    source=signal.Signals(signum).name,
                )
            self._signal_workers(relay)
            if signum == signal.SIGINT and not first:
                self._escalate()

    def cut_off_if_due(self, now: float) -> None:
        if self.cut_off_at is not None and now >= self.cut_off_at and self.interrupted is None:
            self._cut_short()

    def _cut_short(self) -> None:
        """The scheduler's kill is seconds away and the workers are still at it: end them now."""
        self.interrupted = "preemption" if self.stop_cause == StopCause.PREEMPTION else "timeout"
        self.ledger.append(
            STOP_OVERDUE,
            cause=self.interrupted,
            reason="the stop save did not finish before the scheduler's kill; the workers were ended",
        )
        for pid in self.worker_pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def _classify(self, signum: int, at: float) -> tuple[StopCause, int]:
        if signum in (signal.SIGUSR1, signal.SIGUSR2):
            return StopCause.TIMEOUT, signal.SIGUSR1
        if signum == signal.SIGINT:
            return StopCause.USER, signal.SIGINT
        if signum == signal.SIGTERM:
            # Only the scheduler knows whether a SIGTERM is its time limit, a requeue or a
            # cancellation (a warning before it proves nothing: `scancel` may follow a warning).
            what = self.scheduler.termination_cause(self.paths, self.ctx, now=at)
            if self.cut_off_at is None and self.ctx.is_head:
                self.cut_off_at = at + max(1.0, self.scheduler.kill_grace_s(self.plan) - CUT_OFF_MARGIN_S)
            if what == "cancelled":
                self.cancelled = True
                return StopCause.PREEMPTION, signal.SIGTERM  # save now; the decision will not continue
            if what == "timeout":
                return StopCause.TIMEOUT, signal.SIGUSR1
            return StopCause.PREEMPTION, signal.SIGTERM
        return StopCause.NONE, 0

    def worker_pids(self) -> list[int]:
        if self.proc is None:
            return []
        import psutil

        try:
            # Only torchrun's direct children are trainer ranks; deeper ones (DataLoader workers) are theirs.
            return [p.pid for p in psutil.Process(self.proc.pid).children(recursive=False)]
        except psutil.NoSuchProcess:
            return []

    def _signal_workers(self, signum: int) -> None:
        for pid in self.worker_pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    def _escalate(self) -> None:
        """Second Ctrl-C: stop waiting for the save; torchrun shuts the workers down."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGHUP)
