"""Carrying a decision out through the scheduler: requeue or continuation job, a job without the
excluded nodes, or nothing (the run ends); and the cancellation that lands meanwhile.

``carry_out`` is the node agent's last act in an allocation whose attempt is continued through the
scheduler (the rescue job has its own, ``jobs.rescue``). It records what was done and hands the
run lock to the job that continues the run, or releases it; a continuation submitted held (a PBS
sub-job's) is released only after that hand-over.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Protocol, TypeVar

from ..errors import HpclaunchError, SchedulerError
from ..fsutil import create_exclusive, poll_json
from ..rundir import ENDED, NODE_EXCLUDED, RunLock
from ..rundir.cause import Cause
from ..rundir.events import Cancelled, Event, RescueSubmitted, of_kind
from ..rundir.kinds import AGENT_ERROR
from ..schedulers.protocol import Continuation
from ..schedulers.rescue_job import waiting_rescues
from .allocation import Roster
from .decision_rules import RESUMABLE, Action, Decision
from .fenced import decision_record
from .node_run import NodeRun

T = TypeVar("T")


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


class Leaving(Protocol):
    def __call__(self, decision: Decision, error: str) -> bool: ...


def carry_out(
    decision: Decision,
    node: NodeRun,
    *,
    recheck: Callable[[Decision], Decision],
    record: Recorder,
    release: Callable[[str | None], None],
    leave: Leaving = lambda decision, error: False,
) -> int:
    """Do what ``decision`` says through the node's scheduler; record it; the agent's exit code.
    ``recheck``: the decision again right before the scheduler is asked (a cancellation meanwhile);
    ``release``: hand the run lock to the next job (its id) or release it (None); ``leave``: the
    scheduler kept refusing until the allocation's end came near: True when the run is left, its
    decision published and unrecorded, to the rescue job the scheduler holds on this job (which
    carries it out once this job has ended), False when none waits (the run then ends here,
    resumable: a controller that timed out is no reason for a run to fail)."""
    decision = recheck(decision)
    code = 0
    job_id = None
    by = "agent"
    held = False
    if decision.action is Action.EXCLUDE:
        node.ledger.append(NODE_EXCLUDED, nodes=list(decision.exclude), reason=decision.reason)
    try:
        if decision.action in (Action.CONTINUE, Action.EXCLUDE):
            cont = _patiently(lambda: _continue(decision, node), node, recheck, decision)
            code, job_id, by, held = cont.exit_code, cont.job_id, cont.by, cont.held
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
        error = e.one_line()
        if isinstance(e, SchedulerError) and e.refused_for_good:  # (no rescue or resume can help)
            record(
                Decision(
                    Action.FAIL,
                    decision.cause,
                    f"{decision.reason}; the scheduler refused to continue: {error}",
                )
            )
            release(None)
            return 1
        if leave(decision, error):
            return 1  # (the job ends failed: the rescue held on it starts and continues the run)
        ended = Decision(
            Action.END,
            decision.cause,
            f"{decision.reason}; continuing through the scheduler failed ({error}): the run ends here; "
            f"{RESUMABLE} (hpclaunch submit --resume {node.paths.root})",
        )
        record(ended)
        release(None)
        return 1
    if job_id is not None:
        note_carried(node, job_id=job_id, by=by, exit_code=code, held=held)
    record(decision, job_id=job_id, by=by)
    release(job_id if decision.action in (Action.CONTINUE, Action.EXCLUDE) else None)
    if held and job_id:
        stranded = start_held(node, job_id)
        if stranded is not None:
            withdraw_stranded(node, decision, job_id, stranded)
            return 1
    return code


def leave_to_rescue(
    node: NodeRun, decision: Decision, error: str, *, fenced: Callable[[], bool], epoch: int
) -> bool:
    """The scheduler kept refusing to continue the run: when a rescue job waits on this job
    (``schedulers.rescue_job``), the decision stays published and unrecorded, the lock this
    agent's, and the rescue carries it out once this job has ended (the agent exits 1: the job
    ends failed, which starts it). False when none waits, or when this decider was deposed
    (``fenced``: its authority still holds; ``epoch``: the run lock's it holds)."""
    events = node.ledger.events()
    waiting = set(waiting_rescues(events))
    ours = [e.rescue_job for e in of_kind(events, RescueSubmitted) if str(e.job_id) == node.ctx.job_id]
    rescue = next((r for r in reversed(ours) if r in waiting), None)
    if rescue is None or not fenced():
        return False
    if node.alloc.decision(node.attempt) is None:  # (decided after the checks: not published)
        record = decision_record(
            decision,
            attempt=node.attempt,
            by=node.ctx.hostname,
            epoch=epoch,
            roster=Roster(()),
            next_attempt="",
        )
        node.alloc.publish(node.attempt, record)
    words = (
        f"continuing through the scheduler failed ({error}); the rescue job {rescue} continues the run "
        f"once job {node.ctx.job_id} has ended"
    )
    node.ledger.append(AGENT_ERROR, error=words)
    print(f"hpclaunch: {words}", file=sys.stderr, flush=True)
    return True


def carried_file(node: NodeRun) -> Path:
    return node.paths.attempt_dir(node.attempt) / "carried.json"


def note_carried(node: NodeRun, *, job_id: str, by: str, exit_code: int, held: bool) -> None:
    """What the scheduler call did, written as soon as it returned (before the record, which needs
    the decider's epoch): a decider deposed between the two leaves a fact behind, and the one that
    deposed it records that instead of asking the scheduler again (a second ``scontrol requeue``
    of a requeued job fails, and was recorded FAILED). Created exclusively: the first call's stands."""
    fact = {"job_id": job_id, "by": by, "exit_code": exit_code, "held": held}
    with contextlib.suppress(OSError):
        create_exclusive(carried_file(node), json.dumps(fact) + "\n")


def read_carried(node: NodeRun) -> Continuation | None:
    """The scheduler call another decider made for this attempt (``note_carried``), or None."""
    data = poll_json(carried_file(node))
    if not isinstance(data, dict) or not data.get("job_id"):
        return None
    return Continuation(
        str(data["job_id"]),
        int(data.get("exit_code") or 0),
        str(data.get("by") or "agent"),
        bool(data.get("held")),
    )


def _continue(decision: Decision, node: NodeRun) -> Continuation:
    if decision.action is Action.CONTINUE:
        return node.scheduler.continue_job(node.plan, node.paths, node.ctx)
    return node.scheduler.exclude_nodes(node.plan, node.paths, node.ctx, list(decision.exclude))


# Between the tries of a scheduler call that continues the run: a controller's brief outage or a
# preemption storm's slow answers are outlasted, within the time the allocation has left.
RETRY_PAUSES_S = (1.0, 2.0, 5.0, 10.0, 20.0, 30.0)
RETRY_FOR_S = 600.0  # at most this long in all, where the allocation states no end (local, PBS)
# The last try begins this long before the allocation's end at the latest: after it, a job at its
# time limit is being ended, and the rescue held on it (``afternotok``) is what continues the run.
END_MARGIN_S = 2.0


def retry_deadline(node: NodeRun, now: float) -> float:
    """Until when a scheduler call that continues the run is tried again."""
    end = node.ctx.end_time
    return min(now + RETRY_FOR_S, end - END_MARGIN_S) if end is not None else now + RETRY_FOR_S


def _patiently(
    call: Callable[[], T],
    node: NodeRun,
    recheck: Callable[[Decision], Decision],
    decision: Decision,
) -> T:
    """``call()``, tried again while the scheduler refuses (``SchedulerError``: a timed-out
    ``scontrol requeue``, ``sbatch`` or ``qsub``) and the allocation has time left; the last error
    is raised. Each try is preceded by ``recheck``: a decider deposed meanwhile, or a cancellation,
    stops it. A retry can repeat a call that did act but answered too late: ``continue_job`` asks
    the scheduler first (a requeue done already is not done twice); a second continuation job finds
    the run's lock handed to the first and leaves it alone."""
    deadline = retry_deadline(node, time.time())
    for i in itertools.count():
        try:
            return call()
        except SchedulerError as e:
            pause = RETRY_PAUSES_S[min(i, len(RETRY_PAUSES_S) - 1)]
            if e.refused_for_good or time.time() + pause >= deadline:
                raise
            print(f"hpclaunch: {e.one_line()}; trying again in {pause:.0f} s", file=sys.stderr, flush=True)
        time.sleep(pause)
        if recheck(decision) is not decision:
            raise SchedulerError("cancelled while the scheduler was asked again", where="continue")
    raise AssertionError("unreachable")  # (itertools.count never ends)


RELEASE_PAUSES_S = (0.0, 2.0, 5.0, 10.0)  # a scheduler's brief outage outlasted, then said


def start_held(node: NodeRun, job_id: str) -> str | None:
    """Release the held continuation now that the run's lock is its own (``Continuation.held``),
    tried again within the time the allocation has left; None, or the last error."""
    deadline = retry_deadline(node, time.time())
    error = ""
    for i in itertools.count():
        try:
            node.scheduler.release(node.paths, job_id)
            return None
        except HpclaunchError as e:
            error = e.one_line()
        pause = RELEASE_PAUSES_S[min(i + 1, len(RELEASE_PAUSES_S) - 1)]
        if time.time() + pause >= deadline:
            return error
        print(
            f"hpclaunch: releasing job {job_id} failed ({error}); trying again in {pause:.0f} s",
            file=sys.stderr,
            flush=True,
        )
        time.sleep(pause)
    return error


def withdraw_stranded(node: NodeRun, decision: Decision, job_id: str, error: str) -> None:
    """A held continuation that cannot be released strands the run (it holds the run's lock, so
    even ``submit --resume`` is refused): it is withdrawn, the lock it was handed released, and the
    run ends here, resumable, saying so. Written as the lock's holder no more (it was handed on)."""
    withdrawn = "withdrawn"
    try:
        node.scheduler.cancel(node.paths, job_id)
    except HpclaunchError as e:
        withdrawn = f"not withdrawn either ({e.one_line()}: delete it by hand)"
    lock = RunLock(node.paths)
    with contextlib.suppress(OSError):
        holder = lock.read()
        if holder is not None and holder.job_id == job_id and holder.role == "job":
            lock.release(holder)  # (still queued: the continuation never started)
    reason = (
        f"{decision.reason}; the continuation job {job_id} could not be released ({error}) and was "
        f"{withdrawn}; the run ends here; {RESUMABLE} (hpclaunch submit --resume {node.paths.root})"
    )
    node.ledger.append(ENDED, **Decision(Action.END, decision.cause, reason).ledger_fields(), job_id=job_id)
    print(f"hpclaunch: {reason}", file=sys.stderr, flush=True)
