"""Carrying a decision out through the scheduler: requeue or continuation job, a job without the
excluded nodes, or nothing (the run ends); and the cancellation that lands meanwhile.

``carry_out`` is the node agent's last act in an allocation whose attempt is continued through the
scheduler (the rescue job has its own, ``jobs.rescue``). It records what was done and hands the
run lock to the job that continues the run, or releases it; a continuation submitted held (a PBS
sub-job's) is released only after that hand-over.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable
from typing import Protocol

from ..errors import HpclaunchError
from ..rundir import NODE_EXCLUDED
from ..rundir.cause import Cause
from ..rundir.events import Cancelled, Event, of_kind
from .decision_rules import Action, Decision
from .node_run import NodeRun


class Recorder(Protocol):
    def __call__(self, decision: Decision, *, job_id: str | None = None, by: str = "agent") -> None: ...


def cancelled_meanwhile(
    decision: Decision, *, signalled: bool, events: Iterable[Event], started_at: float
) -> Decision:
    """A cancellation (scancel, qdel: ``signalled``; ``hpclaunch cancel``: a ``cancelled`` event
    since the attempt started) that arrives after the attempt ended but before its continuation
    is asked for is still a cancellation: the decision to continue becomes an end."""
    if decision.action not in (Action.CONTINUE, Action.EXCLUDE):
        return decision
    if signalled or any((e.ts or 0) >= started_at for e in of_kind(events, Cancelled)):
        return Decision(Action.END, Cause.CANCELLED, "cancelled before it could continue; never continued")
    return decision


def carry_out(
    decision: Decision,
    node: NodeRun,
    *,
    recheck: Callable[[Decision], Decision],
    record: Recorder,
    release: Callable[[str | None], None],
) -> int:
    """Do what ``decision`` says through the node's scheduler; record it; the agent's exit code.
    ``recheck``: the decision again right before the scheduler is asked (a cancellation meanwhile);
    ``release``: hand the run lock to the next job (its id) or release it (None)."""
    decision = recheck(decision)
    code = 0
    job_id = None
    by = "agent"
    held = False
    try:
        if decision.action is Action.CONTINUE:
            cont = node.scheduler.continue_job(node.plan, node.paths, node.ctx)
            code, job_id, by, held = cont.exit_code, cont.job_id, cont.by, cont.held
        elif decision.action is Action.EXCLUDE:
            node.ledger.append(NODE_EXCLUDED, nodes=list(decision.exclude), reason=decision.reason)
            cont = node.scheduler.exclude_nodes(node.plan, node.paths, node.ctx, list(decision.exclude))
            code, job_id, held = cont.exit_code, cont.job_id, cont.held
        elif decision.action is Action.FAIL:
            code = 1
    except HpclaunchError as e:
        # A scancel that lands while the requeue is asked for makes the requeue fail: it was a
        # cancellation, not a failure to continue.
        late = recheck(decision)
        if late is not decision:
            record(late)
            release(None)
            return 0
        failed = Decision(
            Action.FAIL, decision.cause, f"{decision.reason}; continuing failed: {e.one_line()}"
        )
        record(failed)
        release(None)
        return 1
    record(decision, job_id=job_id, by=by)
    release(job_id if decision.action in (Action.CONTINUE, Action.EXCLUDE) else None)
    if held and job_id:
        start_held(node, job_id)
    return code


RELEASE_PAUSES_S = (0.0, 2.0, 5.0, 10.0)  # a scheduler's brief outage outlasted, then said


def start_held(node: NodeRun, job_id: str) -> None:
    """Release the held continuation now that the run's lock is its own (``Continuation.held``)."""
    error = ""
    for pause in RELEASE_PAUSES_S:
        time.sleep(pause)
        try:
            node.scheduler.release(node.paths, job_id)
            return
        except HpclaunchError as e:
            error = e.one_line()
    print(
        f"hpclaunch: the continuation job {job_id} waits held and could not be released ({error}); "
        f"the run goes on once it is released (qrls {job_id}), or with hpclaunch submit --resume",
        file=sys.stderr,
        flush=True,
    )
