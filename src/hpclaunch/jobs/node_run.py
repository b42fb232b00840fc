"""One node's run as its agent's parts read it (``decider_role``, ``decider``, ``stop_relay``,
``watching``, ``carry_out``): the run directory, the plan (the agent's one source: ``AgentPlan``), this node's context, the scheduler, the
attempt's ledger and the allocation, in one record built once by the node agent.

The record is frozen: an attempt restarted in place is a new record (``next_in_place``: its own
context and ledger), which the agent hands to each part that outlives an attempt, so that no part
is left with the last attempt's context beside the next one's ledger.
"""

from __future__ import annotations

import dataclasses

from ..rundir import JobPlan, Ledger, RunPaths
from ..schedulers.protocol import NodeContext, Scheduler
from .allocation import Allocation


@dataclasses.dataclass(frozen=True)
class NodeRun:
    paths: RunPaths
    plan: JobPlan
    ctx: NodeContext
    scheduler: Scheduler
    ledger: Ledger  # this attempt's (``attempt``, ``node``), as the agent
    alloc: Allocation  # the allocation's agents (its hosts do not change between attempts)

    @classmethod
    def start(cls, paths: RunPaths, plan: JobPlan, ctx: NodeContext, scheduler: Scheduler) -> NodeRun:
        """The node's run as its agent starts: the first attempt's ledger, the allocation's agents."""
        return cls(
            paths,
            plan,
            ctx,
            scheduler,
            ledger=_agent_ledger(paths, ctx),
            alloc=Allocation(paths, ctx.allocation, ctx.hostname, ctx.hosts),
        )

    @property
    def attempt(self) -> str:
        return self.ctx.attempt

    def next_in_place(self, now: float) -> NodeRun:
        """The next attempt restarted in this allocation, started at ``now``: the same end (what the
        accounting counts is this attempt's own start), its own ledger."""
        clock = self.ctx.clock
        if clock is not None:
            clock = dataclasses.replace(clock, start=now)
        ctx = dataclasses.replace(self.ctx, in_place=self.ctx.in_place + 1, clock=clock)
        return dataclasses.replace(self, ctx=ctx, ledger=_agent_ledger(self.paths, ctx))


def _agent_ledger(paths: RunPaths, ctx: NodeContext) -> Ledger:
    return Ledger(paths, role="agent", attempt=ctx.attempt, node=ctx.node_rank)
