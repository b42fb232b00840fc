"""Watching one attempt from one node, one poll at a time: while its ranks run, and while the decider
waits for the other nodes' reports.

Each poll passes the scheduler's signals on (``stop_relay``), looks whether the deciding agent still
beats (this agent takes the role over when it is next: ``decider_role``), asks the watchdog for a hang
verdict (the decider leads it, the others follow its verdict file) and cuts an overrunning stop save
off before the scheduler's kill, which ends the attempt on every node. ``ended`` is the backstop
for ranks that would wait in a collective after another node's failed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from ..rundir.progress_files import local_progress_dir
from .allocation import LOOK_S, Roster, node_ranks
from .decider_role import DeciderRole
from .node_run import NodeRun
from .stop_relay import StopRelay
from .watchdog import Verdict, Watchdog, Watched


def node_watchdog(node: NodeRun, *, lead: bool, roster: Roster, node_dir: Path | None) -> Watchdog:
    """This node's watchdog over the attempt ``roster`` trains on (``lead``: this agent decides;
    ``node_dir``: where its ranks' heartbeats are, None: in the run directory)."""
    ctx, plan = node.ctx, node.plan
    local = local_progress_dir(node_dir, node.paths.root, ctx.hostname, ctx.attempt) if node_dir else None
    watched = Watched(
        world_size=plan.world_size,
        nccl=plan.backend == "nccl",
        smoke_timeout_s=float(node.plan.agent.smoke_timeout_s),
        local_dir=local,
        local_ranks=plan.procs_per_node if ctx.hostname in roster.training else 0,
        alone=roster.training == (ctx.hostname,),
        shared_files=node_dir is None,
    )
    dog = Watchdog(node.plan.agent.watchdog, node.paths, ctx, node.ledger, watched, lead=lead)
    dog.ack_nodes = list(node_ranks(ctx.hosts, roster.training))
    return dog


class AttemptWatch:
    """One attempt watched from this node; ``hang`` is the watchdog's verdict once it has one."""

    def __init__(
        self,
        node: NodeRun,
        *,
        relay: StopRelay,
        role: DeciderRole,
        roster: Roster,
        watchdog: bool = True,
        hang: Verdict | None = None,
        node_dir: Path | None = None,
    ) -> None:
        """``node_dir``: this user's node directory, shared with this node's ranks (None: none is,
        and they report in the run directory)."""
        self.node = node
        self.relay = relay
        self.role = role
        self.roster = roster
        self.hang = hang
        self.watchdog: Watchdog | None = None
        if watchdog and node.plan.agent.watchdog.enabled:
            self.watchdog = node_watchdog(node, lead=role.leads, roster=roster, node_dir=node_dir)
        self._next_end_look = 0.0  # when this agent next looks for the attempt's ``end`` file
        # The first evidence of a death (``links``): the decider holds a connection to every node
        # it waits for, the others one to the decider.
        node.alloc.watch(roster.training if role.leads else roster.nodes[:1])

    def poll(self, pids: Callable[[], list[int]]) -> None:
        """One poll: signals, the decider's liveness, and (the decider's role) the watchdog's
        verdict and the stop-save cut-off, which ends the attempt everywhere."""
        self.relay.handle_signals()
        if self.role.leads and self.role.lost_lock:
            # (its lock's heartbeat found another holder: no watchdog verdict or cut-off from here)
            self.role.step_down("lead the watchdog")
        if not self.role.leads and self.role.gone(self.roster, LOOK_S):
            self.role.take_over()
        if self.watchdog is not None:
            self.watchdog.lead = self.role.leads
            if self.hang is None:
                self.hang = self.watchdog.check(pids)
        overdue = self.relay.interrupted is None
        self.relay.cut_off_if_due(time.time())
        if overdue and self.relay.interrupted is not None:
            self.node.alloc.signal_end(
                self.node.ctx.attempt, f"node {self.node.ctx.hostname}: the stop save overran"
            )

    def final(self) -> None:
        """The attempt is over here: the watchdog's last look (``Watchdog.final``)."""
        if self.watchdog is not None:
            self.watchdog.lead = self.role.leads
            self.watchdog.final()

    def ended(self) -> bool:
        """The attempt's ``end`` file exists (another node's ranks ended it), looked at once per
        ``LOOK_S``: a peer's failure usually reaches this node's ranks first, through their
        collectives; this is the backstop for ranks that would wait in one."""
        now = time.monotonic()
        if now < self._next_end_look:
            return False
        self._next_end_look = now + LOOK_S
        return self.node.alloc.ended(self.node.ctx.attempt)
