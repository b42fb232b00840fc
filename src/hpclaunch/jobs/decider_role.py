"""The decider's role, as one node agent holds it: whether it decides (``leads``), the run lock it
holds and its epoch, taking the role over, stepping down, and handing the lock on.

The role (``allocation``: the first live agent in roster order) moves: when the deciding agent stops
beating or its node leaves the roster, the next one takes it, with the run lock's next epoch
(``RunLock.take_role``). A role without that epoch can write nothing: before each write only the
decider may make, it asks ``fenced``; deposed, it steps down and follows. The other agents wait for
the published decision (``await_decision``). What the decider decides, and how, is ``decider``'s.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable

from ..rundir import Heartbeat, LockHolder, RunLock
from ..rundir.lock import HEARTBEAT_EVERY_S
from ..schedulers.protocol import NodeContext
from .allocation import BEAT_S, POLL_S, DecisionRecord, Roster
from .node_checks import StartBarrier, Word
from .node_run import NodeRun
from .stop_relay import StopRelay


class DeciderRole:
    """This agent's part in the role: the flag, the run lock it holds (and beats), and its moves
    (take over, follow the roster, step down when deposed, hand the lock on)."""

    def __init__(self, node: NodeRun, relay: StopRelay) -> None:
        self.node = node
        self.relay = relay
        self.lock = RunLock(node.paths)
        self.holder: LockHolder | None = None  # the run lock, once admitted or taken over
        self.beat_every_s = HEARTBEAT_EVERY_S
        self._beat: Heartbeat | None = None  # the lock's heartbeat, while this agent holds it
        self.leads = node.ctx.is_head  # node 0 decides at first; the role moves (``follow``)
        self._next_look = 0.0  # when this agent next looks whether the decider still beats
        # What this agent does once it has taken the role over (``Decider``: record the last
        # in-place decision it followed, perhaps recorded by nobody).
        self.taken_over: Callable[[], None] = lambda: None

    @property
    def attempt(self) -> str:
        return self.node.attempt

    @property
    def ctx(self) -> NodeContext:
        return self.node.ctx  # this attempt's

    @property
    def epoch(self) -> int:
        """The run lock's epoch this agent holds (0: none; one node, nobody else decides there)."""
        return self.holder.epoch if self.holder is not None else 0

    def next_attempt(self, node: NodeRun) -> None:
        """The agent restarted in place: the next attempt's context and ledger."""
        self.node = node

    def gone(self, roster: Roster, every_s: float = BEAT_S) -> bool:
        """The deciding agent is gone and this agent is next in roster order: its connection ended
        (``links``: the first evidence, looked at every time), or its heartbeat stopped (looked at
        once per ``every_s``: one small read of the decider's file; ``LOOK_S`` while an attempt runs,
        once per beat otherwise)."""
        now = time.monotonic()
        ahead = (
            roster.nodes[: roster.nodes.index(self.ctx.hostname)] if self.ctx.hostname in roster.nodes else ()
        )
        if now < self._next_look and not any(self.node.alloc.known_dead(h) for h in ahead):
            return False  # (a connection that ended is looked at every time: it costs no read)
        self._next_look = now + every_s
        return self.node.alloc.decider(roster) == self.ctx.hostname

    def follow(self, roster: Roster) -> None:
        """The roster changed: the role goes to its first live agent (a node the roster left, or a
        dead one, hands it on; the next takes it, with the run lock). An agent whose turn it is
        again after it was deposed (it stalled past the window, another took the role, and now it
        is the first live agent again) claims the role anew: a role without the lock's epoch can
        write nothing."""
        mine = self.node.alloc.decider(roster) == self.ctx.hostname
        if mine and (not self.leads or not self.fenced()):
            self.take_over()
        elif not mine and self.leads:
            self.leads = False
        self.relay.lead = self.leads

    def take_over(self) -> bool:
        """The deciding agent is gone (or its node left the roster): this one decides from now on,
        when it claims the run lock's next epoch from its own job (``RunLock.take_role``). False:
        another agent claimed it first, or the lock has gone to another job; this one follows."""
        holder = None
        with contextlib.suppress(OSError):
            holder = self.lock.take_role(job_id=self.ctx.job_id)
        self.leads = self.relay.lead = holder is not None
        if holder is None:
            print(
                f"hpclaunch: node {self.ctx.hostname} does not take the decider's role: another agent "
                "claimed it first, or the run's lock has gone to another job",
                file=sys.stderr,
                flush=True,
            )
            return False
        print(
            f"hpclaunch: node {self.ctx.hostname} decides from now on (the deciding agent is gone or "
            f"its node left the roster; the run lock's epoch {holder.epoch})",
            file=sys.stderr,
            flush=True,
        )
        self.hold(holder)
        self.taken_over()
        return True

    def hold(self, holder: LockHolder | None) -> None:
        """This agent holds the run lock as ``holder`` (admitted, or the role taken over) and beats
        it (or the lock goes stale and another submission could take the run while this allocation
        still trains it)."""
        self.close()
        self.holder = holder
        if holder is not None:
            self._beat = Heartbeat(self.lock, holder, every_s=self.beat_every_s).__enter__()

    @property
    def lost_lock(self) -> bool:
        """The lock's heartbeat found the lock another's (``Heartbeat.lost``): deposed; no read."""
        return self._beat is not None and self._beat.lost

    def fenced(self) -> bool:
        """This decider's authority still holds: no later epoch of the run lock was claimed (it was
        not deposed while it stalled). Asked right before each write only the decider may make.
        Always true where it holds no lock (one node under the local controller or a foreground
        ``train``, which hold it: nobody else can decide there)."""
        if self.holder is None:
            return True
        if self.lost_lock:
            return False  # (its heartbeat found the lock another's: deposed, whatever a read says now)
        try:
            return self.lock.holds(self.holder)
        except OSError:
            return True  # cannot tell now: the exclusive files still keep one decision

    def step_down(self, what: str) -> None:
        """Deposed: another agent claimed the role while this one stalled; it follows from now on."""
        self.leads = self.relay.lead = False
        print(
            f"hpclaunch: node {self.ctx.hostname} was deposed as the decider (another agent took the "
            f"role while it stalled); it does not {what} and follows",
            file=sys.stderr,
            flush=True,
        )

    def announce(self, barrier: StartBarrier, *, go: bool, roster: Roster, reason: str) -> Word | None:
        """The start's word under this decider's epoch: None when it was deposed before it could say
        it (it follows from now on); else the word that stands (``go.json`` is created exclusively:
        a second decider's word, a deposed one's included, never replaces the first; ``Word.ours``
        says whether it is this one's)."""
        if not self.fenced():
            self.step_down("announce the start")
            return None
        return barrier.announce(
            go=go,
            reason="" if go else reason,
            roster=roster.to_json() if go else None,
            epoch=self.epoch,
        )

    def close(self) -> None:
        """Stop the lock's heartbeat this agent started."""
        if self._beat is not None:
            self._beat.__exit__(None, None, None)
            self._beat = None

    def await_decision(self, roster: Roster) -> DecisionRecord | None:
        """The decision on this attempt as the decider published it, or None when this agent
        decides (it does, or it took the role over while it waited)."""
        while not self.leads:
            published = self.node.alloc.decision(self.attempt)
            if published is not None:
                return published
            self.relay.handle_signals()
            if self.gone(roster) and self.take_over():
                break
            time.sleep(POLL_S)
        return None

    def release_lock(self, next_job: str | None) -> None:
        """Hand the lock to the job that continues the run, or release it when the run stops here."""
        if self.holder is None:
            return
        handed = True
        with contextlib.suppress(OSError):
            if next_job is not None and next_job != "":
                handed = self.lock.hand_over(self.holder, next_job)
            else:
                self.lock.release(self.holder)
        if not handed:
            print(
                f"hpclaunch: the run lock was not handed to job {next_job}: it is not this agent's any "
                "more (that job adopted it, or another agent took the decider's role)",
                file=sys.stderr,
                flush=True,
            )
