"""May this attempt run? Node 0's question before anything starts (the rest of the allocation waits
for its word at the start barrier).

- A run that has already ended (finished, failed, cancelled) is withdrawn: the job leaves without
  touching the run (``decide_start``).
- The run-directory lock: another live writer (a second submission, a foreground ``train``) makes
  this attempt refuse, recorded; else this job adopts the lock.
- The attempt before this one may have no decision (its agents were killed first): it is decided
  now, once, as the preemption it was (``decide_unended``); when that spends more than the budget
  the run fails and this attempt is withdrawn.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import HpclaunchError
from ..rundir import REFUSED, Ledger, LockHolder, RunLock, RunPaths
from ..rundir.events import Event
from ..rundir.lock import liveness
from ..schedulers.registry import get_scheduler
from .decision_rules import Action, Budgets, History, decide_start, decide_unended, unended_attempt
from .node_run import NodeRun


@dataclass
class Admission:
    refusal: str | None  # None: this attempt runs; else why not (already recorded)
    holder: LockHolder | None  # the lock this agent holds for the run (None: someone else's, or none)


def admit(
    node: NodeRun, *, lock: RunLock, record: Callable[..., None], held: LockHolder | None = None
) -> Admission:
    """Node 0's answer (see the module docstring) for ``node``'s attempt; ``record(decision,
    **fields)`` appends a decision to the ledger the way the agent does. ``held``: the lock this
    agent holds already (it took the decider's role over before node 0's agent could admit the
    attempt)."""
    paths, ctx, scheduler, ledger = node.paths, node.ctx, node.scheduler, node.ledger
    events = ledger.events()
    withdraw = decide_start(History.from_events(events))
    if withdraw is not None:
        record(withdraw, note=scheduler.withdraw(paths, ctx))
        if held is not None:
            with contextlib.suppress(OSError):
                lock.release(held)
        return Admission(withdraw.reason, None)
    if held is not None:
        return _settled(events, held, node, lock=lock, record=record)
    holder = lock.read()
    # "" is a submission that has not learned its job id yet: this job, just started.
    ours = holder is None or holder.job_id in ("", ctx.job_id)
    live = (
        liveness(holder, is_active=lambda h: _active(paths, h)) if holder is not None and not ours else None
    )
    if holder is not None and live is not None and live.alive:
        reason = (
            f"the run directory is held by {holder.describe()} ({live.why}); this attempt does not touch it"
        )
        ledger.append(REFUSED, reason=reason, holder=holder.job_id)
        print(f"hpclaunch: {reason}", file=sys.stderr, flush=True)
        return Admission(reason, None)
    mine = None
    if holder is None or holder.job_id != ctx.job_id or holder.role not in ("controller", "train"):
        # (else the local controller / the foreground command holds it for this job)
        mine = lock.adopt(job_id=ctx.job_id, role="agent")
    return _settled(events, mine, node, lock=lock, record=record)


def _settled(
    events: list[Event], mine: LockHolder | None, node: NodeRun, *, lock: RunLock, record: Callable[..., None]
) -> Admission:
    """The attempt before this one settled (``_settle_unended``); the lock released when that ends
    the run."""
    refusal = _settle_unended(events, node, record=record)
    if refusal is not None and mine is not None:
        with contextlib.suppress(OSError):
            lock.release(mine)  # the run ended here: nobody continues it
        mine = None
    return Admission(refusal, mine)


def _settle_unended(events: list[Event], node: NodeRun, *, record: Callable[..., None]) -> str | None:
    """The attempt before this one, decided now if nobody did; None, or why this one is withdrawn."""
    paths, plan, ctx, scheduler = node.paths, node.plan, node.ctx, node.scheduler
    previous = unended_attempt(events, ctx.attempt)
    if previous is None:
        return None
    decision = decide_unended(previous, History.from_events(events), Budgets.from_plan(plan))
    continued = decision.action is Action.CONTINUE
    record(
        decision,
        job_id=ctx.job_id if continued else None,
        by="scheduler",
        ledger=Ledger(paths, role="agent", attempt=previous, node=ctx.node_rank),
    )
    if continued:
        return None
    withdraw = decide_start(History(ended=decision.event))  # the run has just ended: failed
    assert withdraw is not None
    record(withdraw, note=scheduler.withdraw(paths, ctx))
    return withdraw.reason  # (agent_main tells the runs chained after this one)


def _active(paths: RunPaths, holder: LockHolder) -> bool | None:
    try:
        return get_scheduler(holder.scheduler).status(paths, holder.job_id).active
    except (HpclaunchError, ValueError):
        return None  # cannot ask: the lock assumes the other writer is alive
