"""What happens after an attempt, and whether a new attempt may start: two pure functions.

The decider (a role that moves with the roster: node 0's agent while it lives) gathers the facts
(the trainer's outcome, what the scheduler says about the SIGTERM it got, the node checks of every
node, budgets already spent according to the ledger) and calls ``decide``; it then carries the
Decision out through the scheduler Protocol. One agent decides; the others report. The rescue job
applies the same ``decide`` to an attempt that ended before any agent could. ``decide_start`` runs when an attempt begins: an attempt that the scheduler
started although the run had already ended (a preempted job requeued by Slurm after
``max_requeues`` was spent, a requeue after a finish) is withdrawn instead of training on.

A hang (the watchdog's verdict) is its own cause: continued from the last checkpoint within
``max_hang_retries``, on SLURM without the node the evidence names; never counted as a crash.

Where a continuation happens is part of the decision. In place (``Decision.in_place``): the agents
of this allocation start the next attempt themselves, from the last checkpoint, with no new job and
no trip through the queue, when the cause does not need a new allocation (a crash, a hang, a node
that a hot spare can replace) and the allocation has time left (``Facts.in_place_ok``). Through the
scheduler otherwise: a time limit, a preemption or a user's continue (the allocation is ending), or
a failed node with no spare left (SLURM excludes it, PBS Pro names healthy hosts).

The user's intent wins over everything that would continue the run: a ``hpclaunch stop`` (without
``--continue``) ends the run after the attempt, whatever else ended it (a scheduler warning that
came in the same attempt, a crash or a hang before the save). Only a cancellation, a finish and
the run's own failures say more.

Every case is a row of ``tests/unit/test_decide.py``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

from ..rundir import (
    CANCELLED,
    ENDED,
    FAILED,
    FINISHED,
    HELD,
    REFUSED,
    REQUEUED,
    RUN_ENDS,
    STARTED,
    SUBMITTED,
    SUBMITTING,
    AttemptOutcome,
)
from ..rundir.cause import Budget, Cause, UnknownCause
from ..rundir.events import (
    Event,
    NodeExcluded,
    NodeReplaced,
    Requeued,
    Submitted,
    Submitting,
)

if TYPE_CHECKING:
    from ..rundir import JobPlan


# No command named: a submitted run continues with `submit --resume` (status says so), a foreground
# one with `train ... --resume` (the command says so); this reason is printed by both.
RESUMABLE = "it can be resumed from its last checkpoint"


class Action(str, Enum):
    FINISH = "finish"  # every step done
    CONTINUE = "continue"  # come back from the last checkpoint (requeue, continuation, restart)
    EXCLUDE = "exclude"  # come back as a job that avoids the nodes in Decision.exclude
    END = "end"  # stop here; `hpclaunch submit --resume` may continue later (user stop, cancel)
    FAIL = "fail"  # the run failed; Decision.reason says why in the user's words
    WITHDRAW = "withdraw"  # (start only) this attempt should not run: cancel/hold it


@dataclass(frozen=True)
class Facts:
    """What node 0 knows when its attempt is over."""

    outcome: AttemptOutcome | None  # None: the trainer left none (a crash)
    returncode: int = 0  # the rank host's (its elastic launch's)
    cancelled: bool = False  # scancel/qdel/`hpclaunch cancel` (scheduler's answer or ledger event)
    user_stop: bool = False  # the user's `hpclaunch stop` was pending when the attempt ended
    continue_requested: bool = False  # ... with --continue
    failed_nodes: tuple[str, ...] = ()  # nodes whose node checks failed (any node, head included)
    node_problems: Mapping[str, str] = field(default_factory=dict)  # node -> what failed there
    data_error: str | None = None  # the data check failed everywhere it ran: the data, not a node
    hang: str | None = None  # the watchdog's verdict in words (phase, step, culprit); None: no hang
    hang_node: str | None = None  # the one node the hang's evidence names, if it names one
    # The stop the agent was relaying (timeout/preemption) when it had to end the attempt before
    # the scheduler's kill: the trainer never finished its stop save (or never began training).
    interrupted: Cause | None = None
    # The run directory could not be read while deciding (the outcome file: EIO, ESTALE): the
    # attempt is treated as a filesystem failure, retried like a crash.
    read_error: str | None = None
    dead_nodes: tuple[str, ...] = ()  # training nodes whose agent is gone (no report, no heartbeat)
    # What ended an attempt that left no outcome, in words, when it is known (the rescue: how the
    # scheduler ended the job, an agent's own error): the failure's reason instead of a guess.
    ended_by: str = ""
    # The node a crash is attributed to (``jobs.attribution``), what says so, and whether that
    # evidence is enough to evict it at once (GPU/ECC/Xid text, a failed check) or only a hint
    # (its ranks died first): a hinted node is evicted when it is the suspect a second time.
    suspect: str | None = None
    suspect_evidence: str = ""
    suspect_certain: bool = False
    # The newest checkpoint's step in the run directory now (None: none yet): what the next attempt
    # resumes from. Failures continued in a row from the same one are a restart loop.
    newest_checkpoint: int | None = None
    spares: tuple[str, ...] = ()  # healthy hot spares waiting in this allocation, in order
    # The allocation can carry another attempt (no stop pending, time left): a continuation that
    # needs no new allocation happens in place.
    in_place_ok: bool = False


@dataclass(frozen=True)
class History:
    """Budgets already spent by this run, counted from the ledger since its latest submission."""

    requeues: int = 0  # timeout, preemption, user continue
    crash_retries: int = 0  # crash, filesystem
    hang_retries: int = 0
    node_excludes: int = 0  # nodes kept off: excluded by a new job, or replaced by a spare in place
    excluded: tuple[str, ...] = ()  # nodes earlier decisions kept the run off
    ended: str | None = None  # the run already ended (finished/failed/...): the event name
    suspected: Mapping[str, int] = field(default_factory=dict)  # node -> crashes attributed to it
    # The newest checkpoint each failure continued in a row resumed from (their `checkpoint`), since
    # the last continuation that was not a failure's: NVRx's "no progress" count comes from it.
    failure_checkpoints: tuple[int | None, ...] = ()

    def no_progress(self, newest: int | None) -> int:
        """Failures continued in a row, the last ones, from the checkpoint that is still the newest."""
        count = 0
        for step in reversed(self.failure_checkpoints):
            if step != newest:
                break
            count += 1
        return count

    @classmethod
    def from_events(cls, events: Iterable[Event]) -> History:
        """What the ledger's typed events (``Ledger.events()``, ``read_events``) say was spent."""
        spent = dict.fromkeys(Budget, 0)
        excludes = 0
        excluded: list[str] = []
        ended: str | None = None
        suspected: dict[str, int] = {}
        failures: list[int | None] = []  # the checkpoint of each failure continued in a row
        for e in events:
            kind = e.event
            # `submitting` is written before the scheduler is asked, `submitted` once it answered:
            # an attempt may start in between, and must already see the run started again.
            if isinstance(e, (Submitting, Submitted)) and not e.resume:
                spent = dict.fromkeys(Budget, 0)
                excludes, excluded, ended, suspected, failures = 0, [], None, {}, []
            elif kind in (SUBMITTING, SUBMITTED):
                ended = None  # `submit --resume` starts the run again; budgets carry on
            elif isinstance(e, Requeued):
                budget = _budget_of(e)
                if budget is not None and budget is not Budget.NODE:  # node: counted by exclusions
                    spent[budget] += 1
                if budget is not None and budget.after_failure:
                    failures.append(e.checkpoint)
                else:
                    failures = []
                if e.suspect:
                    suspected[e.suspect] = suspected.get(e.suspect, 0) + 1
            elif isinstance(e, (NodeExcluded, NodeReplaced)):
                excludes += 1
                older = [e.excluded] if isinstance(e, NodeExcluded) else []
                excluded += [n for n in e.nodes or older if n]
            elif kind in RUN_ENDS:
                ended = str(kind)
        return cls(
            spent[Budget.REQUEUE],
            spent[Budget.CRASH],
            spent[Budget.HANG],
            excludes,
            tuple(dict.fromkeys(excluded)),
            ended,
            suspected,
            tuple(failures),
        )


def _budget_of(event: Requeued) -> Budget | None:
    """The budget a recorded continuation spent (a cause or budget this version does not know
    spends none: it cannot be counted against a budget nobody defined)."""
    if event.counts_as:  # what the decision said it spent (a crash that evicted a node: node)
        return Budget.parse_optional(event.counts_as)
    try:
        cause = Cause.parse_optional(event.cause)
    except UnknownCause:
        return None
    return cause.budget if cause is not None else None


@dataclass(frozen=True)
class Budgets:
    max_requeues: int
    max_failure_retries: int
    max_node_excludes: int
    max_hang_retries: int = 3
    max_restarts_without_progress: int = 3

    @classmethod
    def from_plan(cls, plan: JobPlan) -> Budgets:
        """Every budget comes from the plan (one place, written at submission)."""
        return cls(
            max_requeues=plan.max_requeues,
            max_failure_retries=plan.max_failure_retries,
            max_node_excludes=plan.max_node_excludes,
            max_hang_retries=plan.max_hang_retries,
            max_restarts_without_progress=plan.max_restarts_without_progress,
        )


@dataclass(frozen=True)
class Decision:
    action: Action
    cause: Cause | None  # finished -> None; else the cause kept all the way to `status`
    reason: str  # one line, the user's words
    exclude: tuple[str, ...] = ()
    counts_as: Budget | None = None  # the budget this continuation spends
    in_place: bool = False  # CONTINUE: the agents of this allocation start the next attempt
    replace: tuple[tuple[str, str], ...] = ()  # in place: (failed node, the spare taking its place)
    suspect: str | None = None  # the node a crash was pinned on (counted: a second time evicts it)

    def ledger_fields(self) -> dict[str, Any]:
        """The fields every record of this decision carries (an agent's, the rescue's)."""
        fields: dict[str, Any] = {"cause": self.cause, "reason": self.reason, "action": self.action.value}
        if self.action is Action.FAIL:
            fields["error"] = self.reason
        if self.exclude:
            fields["exclude"] = list(self.exclude)
        return fields

    @property
    def event(self) -> str:
        """The ledger event that records this decision."""
        return {
            Action.FINISH: FINISHED,
            Action.CONTINUE: REQUEUED,
            Action.EXCLUDE: REQUEUED,
            Action.END: CANCELLED if self.cause is Cause.CANCELLED else ENDED,
            Action.FAIL: FAILED,
            Action.WITHDRAW: HELD,
        }[self.action]


def decide(facts: Facts, history: History, budgets: Budgets, *, can_exclude_nodes: bool) -> Decision:
    """The one decision after an attempt (see the module docstring)."""
    if facts.data_error is not None:
        return Decision(Action.FAIL, Cause.DATA, f"bad training data: {facts.data_error}")
    out = facts.outcome
    if facts.cancelled:
        saved = f" after step {out.step}" if out is not None and out.status == "stopped" else ""
        return Decision(Action.END, Cause.CANCELLED, f"cancelled{saved}; never continued")
    if out is not None and out.status == "finished":
        return Decision(Action.FINISH, None, f"finished at step {out.step}")
    if out is not None and out.status == "failed" and out.cause is not None and out.cause.is_own_failure:
        # The run's own verdict (non-finite steps, incompatible checkpoint, bad data): the same code
        # on the same data would fail again, so it is never retried.
        return Decision(Action.FAIL, out.cause, out.error or "the trainer failed")
    if facts.user_stop and not facts.continue_requested:
        return _user_end(facts)
    stalled = _no_progress(history, budgets, facts.newest_checkpoint)
    if stalled is not None and _is_failure(facts):
        what = facts.hang or (out.error if out is not None and out.error else None) or "the attempt failed"
        cause = _failure_cause(facts)
        return Decision(Action.FAIL, cause, f"{what}; {stalled}")
    if facts.failed_nodes or facts.dead_nodes:
        return _node_failure(facts, history, budgets, can_exclude_nodes)
    if facts.hang is not None:
        return _hang(facts, history, budgets, can_exclude_nodes)
    if out is None and facts.interrupted is not None:
        return _within(
            facts.interrupted,
            f"the {facts.interrupted} came before the attempt could save; it resumes from its last checkpoint",
            used=history.requeues,
            budget=budgets.max_requeues,
            what="requeues",
        )
    if facts.read_error is not None and out is None:
        return _within(
            Cause.FILESYSTEM,
            facts.ended_by or f"the attempt's outcome could not be read: {facts.read_error}",
            used=history.crash_retries,
            budget=budgets.max_failure_retries,
            what="failure retries",
            in_place=facts.in_place_ok,
        )
    if out is None or out.status == "failed":
        cause = Cause.CRASH if out is None or out.cause is None else out.cause
        error = (out.error if out is not None else None) or (
            facts.ended_by or f"the ranks exited with {facts.returncode} and the trainer left no outcome"
        )
        if cause is Cause.HANG:
            hung = Facts(out, hang=error, in_place_ok=facts.in_place_ok)
            return _hang(hung, history, budgets, can_exclude_nodes)
        evicted = _evict_suspect(cause, error, facts, history, budgets, can_exclude_nodes)
        if evicted is not None:
            return dataclasses.replace(evicted, suspect=facts.suspect)
        if facts.suspect is not None:
            error = f"{error}; {facts.suspect} is suspect: {facts.suspect_evidence}"
        retried = _within(
            cause,
            error,
            used=history.crash_retries,
            budget=budgets.max_failure_retries,
            what="failure retries",
            in_place=facts.in_place_ok,
        )
        return (
            dataclasses.replace(retried, suspect=facts.suspect)
            if retried.action is Action.CONTINUE
            else retried
        )
    cause = out.cause or Cause.USER
    if cause is Cause.USER and not facts.continue_requested:
        return Decision(Action.END, Cause.USER, f"stopped by the user after step {out.step}; {RESUMABLE}")
    return _within(
        cause,
        f"stopped after step {out.step} ({cause})",
        used=history.requeues,
        budget=budgets.max_requeues,
        what="requeues",
    )


def _is_failure(facts: Facts) -> bool:
    """The attempt ended in a failure that would be continued (crash, hang, node, filesystem), not
    in a stop the allocation's end asked for."""
    out = facts.outcome
    if facts.failed_nodes or facts.dead_nodes or facts.hang is not None:
        return True
    if out is None:
        return facts.interrupted is None
    return out.status == "failed"


def _failure_cause(facts: Facts) -> Cause:
    out = facts.outcome
    if facts.failed_nodes or facts.dead_nodes:
        return Cause.NODE_FAILURE
    if facts.hang is not None:
        return Cause.HANG
    if out is None and facts.read_error is not None:
        return Cause.FILESYSTEM
    return out.cause if out is not None and out.cause is not None else Cause.CRASH


def _no_progress(history: History, budgets: Budgets, newest: int | None) -> str | None:
    """Why the run stops restarting: it was continued this many times in a row after a failure and
    the newest checkpoint is still the one it resumed from (a restart loop that only burns the
    allocation). None while it may go on."""
    count = history.no_progress(newest)
    if count < budgets.max_restarts_without_progress:
        return None
    which = f"the newest is step {newest}" if newest is not None else "there is none yet"
    return (
        f"no progress: {count} restarts in a row without a new checkpoint ({which}; "
        f"scheduler.max_restarts_without_progress={budgets.max_restarts_without_progress})"
    )


def _evict_suspect(
    cause: Cause, error: str, facts: Facts, history: History, budgets: Budgets, can_exclude: bool
) -> Decision | None:
    """A crash the evidence pins on one node: certain evidence (GPU/ECC/Xid text), or the same node
    suspected a second time, takes it out of the run at once (a spare in its place, else a new job
    without it), within the node budget; a first hint only restarts (None: not evicted)."""
    node = facts.suspect
    if node is None or not (facts.suspect_certain or history.suspected.get(node, 0) >= 1):
        return None
    if history.node_excludes >= budgets.max_node_excludes:
        return None  # no node budget left: an ordinary retry, within the crash budget
    again = "" if facts.suspect_certain else " (the second crash pinned on it)"
    what = f"{error}; {node} is suspect: {facts.suspect_evidence}{again}"
    if facts.in_place_ok and facts.spares:
        spare = facts.spares[0]
        return Decision(
            Action.CONTINUE,
            cause,
            f"{what}; restarting in place, {spare} taking the place of {node}",
            counts_as=Budget.NODE,
            in_place=True,
            replace=((node, spare),),
        )
    if can_exclude:
        return Decision(
            Action.EXCLUDE,
            cause,
            f"{what}; continuing without {node}",
            exclude=tuple(sorted({*history.excluded, node})),
            counts_as=Budget.NODE,
        )
    return None


def _user_end(facts: Facts) -> Decision:
    """``hpclaunch stop`` was pending: the run ends here whatever else ended the attempt."""
    out = facts.outcome
    if out is not None and out.status == "stopped":
        why = (
            ""
            if out.cause is Cause.USER
            else f" (the attempt also heard: {out.cause.words if out.cause else '?'})"
        )
        return Decision(
            Action.END,
            Cause.USER,
            f"stopped by the user after step {out.step}{why}; {RESUMABLE}",
        )
    ended = facts.hang or (out.error if out is not None and out.error else None)
    ended = ended or (f"the {facts.interrupted} came before the save" if facts.interrupted else None)
    ended = ended or "the attempt ended before it could save"
    return Decision(
        Action.END,
        Cause.USER,
        f"{ended}; stopped by the user: {RESUMABLE}",
    )


def _within(
    cause: Cause, reason: str, *, used: int, budget: int, what: str, in_place: bool = False
) -> Decision:
    if used >= budget:
        return Decision(Action.FAIL, cause, f"{reason}; {used} {what} used of {budget}")
    if in_place:
        reason = f"{reason}; restarting in place ({used + 1} of {budget} {what})"
    return Decision(Action.CONTINUE, cause, reason, counts_as=cause.budget, in_place=in_place)


def _in_place(cause: Cause, reason: str, replace: tuple[tuple[str, str], ...] = ()) -> Decision:
    """Restart in the same allocation, a spare taking the place of each node in ``replace``."""
    took = ", ".join(f"{spare} taking the place of {node}" for node, spare in replace)
    return Decision(
        Action.CONTINUE,
        cause,
        f"{reason}, {took}" if took else reason,
        counts_as=cause.budget,
        in_place=True,
        replace=replace,
    )


def _hang(facts: Facts, history: History, budgets: Budgets, can_exclude: bool) -> Decision:
    """A hang: the workers were stopped without a save, so the run continues from its last
    checkpoint, within its own budget; off the hung node where the scheduler can say so."""
    what = facts.hang or "a rank stopped making progress"
    if history.hang_retries >= budgets.max_hang_retries:
        return _within(
            Cause.HANG, what, used=history.hang_retries, budget=budgets.max_hang_retries, what="hang retries"
        )
    node = facts.hang_node
    # A spare takes the hung node's place in place; else the scheduler keeps the next job off it.
    swap = ((node, facts.spares[0]),) if node is not None and facts.spares and facts.in_place_ok else ()
    if node is not None and can_exclude and not swap:
        return Decision(
            Action.EXCLUDE,
            Cause.HANG,
            f"{what}; continuing from the last checkpoint without {node}",
            exclude=tuple(sorted({*history.excluded, node})),
            counts_as=Budget.HANG,
        )
    if facts.in_place_ok:
        return _in_place(Cause.HANG, f"{what}; restarting in place from the last checkpoint", swap)
    return Decision(
        Action.CONTINUE, Cause.HANG, f"{what}; continuing from the last checkpoint", counts_as=Budget.HANG
    )


def _node_failure(facts: Facts, history: History, budgets: Budgets, can_exclude: bool) -> Decision:
    nodes = tuple(sorted({*facts.failed_nodes, *facts.dead_nodes}))
    problems = {n: "its agent and ranks are gone" for n in facts.dead_nodes} | dict(facts.node_problems)
    what = "; ".join(f"{n}: {problems.get(n, 'failed its node check')}" for n in nodes)
    if history.node_excludes >= budgets.max_node_excludes:
        used, budget = history.node_excludes, budgets.max_node_excludes
        return _within(Cause.NODE_FAILURE, what, used=used, budget=budget, what="node exclusions")
    if facts.in_place_ok and len(facts.spares) >= len(nodes):
        pairs = tuple(zip(nodes, facts.spares, strict=False))
        return _in_place(Cause.NODE_FAILURE, f"{what}; restarting in place", pairs)
    if not can_exclude:
        return Decision(
            Action.FAIL,
            Cause.NODE_FAILURE,
            f"{what}; this scheduler cannot keep a continuation off a node, so the run stops here "
            "(fix or drain the node, then submit --resume)",
        )
    return Decision(
        Action.EXCLUDE,
        Cause.NODE_FAILURE,
        f"{what}; continuing without {', '.join(nodes)}",
        exclude=tuple(sorted({*history.excluded, *nodes})),
        counts_as=Budget.NODE,
    )


# The events that end one attempt: every decision, and the starts that did not run.
_ATTEMPT_ENDS = frozenset((*RUN_ENDS, REQUEUED, REFUSED))


def unended_attempt(events: Iterable[Event], current: str) -> str | None:
    """The attempt before ``current`` that started after the run's latest submission and has no
    decision: its agents were killed before they could write one (an ``scontrol requeue`` or a
    preemption whose SIGKILL came before the stop and save ended, a node that died with node 0's
    agent on it). None when there is none."""
    unended: list[str] = []
    for e in events:
        kind, key = e.event, e.attempt
        if kind in (SUBMITTING, SUBMITTED):
            unended.clear()  # a submission starts the run's story again (budgets too)
        elif kind == STARTED and key and key != current and key not in unended:
            unended.append(str(key))
        elif kind in _ATTEMPT_ENDS and key in unended:
            unended.remove(str(key))
    return unended[-1] if unended else None


def decide_unended(attempt: str, history: History, budgets: Budgets) -> Decision:
    """The decision an attempt that ended without one is given by the attempt the scheduler
    started after it: the scheduler took its nodes (a requeue or a preemption), so it spends a
    requeue like any preemption; over the budget, the run fails here and the new attempt is
    withdrawn, as if the decision had been written in time."""
    return _within(
        Cause.PREEMPTION,
        f"attempt {attempt} ended without a decision (its agents were stopped before they could write "
        "one) and the scheduler started the job again; it resumes from its last checkpoint",
        used=history.requeues,
        budget=budgets.max_requeues,
        what="requeues",
    )


def decide_start(history: History) -> Decision | None:
    """None when this attempt may run; WITHDRAW when the run had already ended before it began."""
    if history.ended is None:
        return None
    return Decision(
        Action.WITHDRAW,
        None,
        f"the scheduler started this attempt although the run had already ended ({history.ended}); "
        "withdrawn without training (hpclaunch submit --resume RUN continues it deliberately)",
    )
