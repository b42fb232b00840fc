"""What happens after an attempt, and whether a new attempt may start: two pure functions.

Node 0's agent gathers the facts (the trainer's outcome, what the scheduler says about the SIGTERM
it got, the node checks of every node, budgets already spent according to the ledger) and calls
``decide``; it then carries the Decision out through the scheduler Protocol. Only node 0 decides;
other nodes report. ``decide_start`` runs when an attempt begins: an attempt that the scheduler
started although the run had already ended (a preempted job requeued by Slurm after
``max_requeues`` was spent, a requeue after a finish) is withdrawn instead of training on.

A hang (the watchdog's verdict) is its own cause: continued from the last checkpoint within
``max_hang_retries``, on SLURM without the node the evidence names; never counted as a crash.

Every case is a row of ``tests/unit/test_decide.py``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from ..rundir import (
    CANCELLED,
    ENDED,
    FAILED,
    FINISHED,
    HELD,
    NODE_EXCLUDED,
    REQUEUED,
    RUN_ENDS,
    SUBMITTED,
    AttemptOutcome,
)
from ..rundir.outcome import STOP_CAUSES


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
    returncode: int = 0  # torchrun's
    cancelled: bool = False  # scancel/qdel/`hpclaunch cancel` (scheduler's answer or ledger event)
    continue_requested: bool = False  # `hpclaunch stop --continue`
    failed_nodes: tuple[str, ...] = ()  # nodes whose node checks failed (any node, head included)
    node_problems: Mapping[str, str] = field(default_factory=dict)  # node -> what failed there
    data_error: str | None = None  # the data check failed everywhere it ran: the data, not a node
    hang: str | None = None  # the watchdog's verdict in words (phase, step, culprit); None: no hang
    hang_node: str | None = None  # the one node the hang's evidence names, if it names one
    user_stop: bool = False  # `hpclaunch stop` was asked for (a hung attempt could not honour it)
    # The stop the agent was relaying (timeout/preemption) when it had to end the attempt before
    # the scheduler's kill: the trainer never finished its stop save (or never began training).
    interrupted: str | None = None


@dataclass(frozen=True)
class History:
    """Budgets already spent by this run, counted from the ledger since its latest submission."""

    requeues: int = 0  # timeout, preemption, user continue
    crash_retries: int = 0
    hang_retries: int = 0
    node_excludes: int = 0
    excluded: tuple[str, ...] = ()  # nodes earlier decisions kept the run off
    ended: str | None = None  # the run already ended (finished/failed/...): the event name

    @classmethod
    def from_events(cls, events: Iterable[Mapping[str, Any]]) -> History:
        requeues = crash = hang = excludes = 0
        excluded: list[str] = []
        ended: str | None = None
        for e in events:
            kind = e.get("event")
            if kind == SUBMITTED and not e.get("resume"):
                requeues = crash = hang = excludes = 0
                excluded, ended = [], None
            elif kind == SUBMITTED:
                ended = None  # `submit --resume` starts the run again; budgets carry on
            elif kind == REQUEUED:
                if e.get("cause") in STOP_CAUSES:
                    requeues += 1
                elif e.get("cause") == "crash":
                    crash += 1
                elif e.get("cause") == "hang":
                    hang += 1
            elif kind == NODE_EXCLUDED:
                excludes += 1
                excluded += [str(n) for n in e.get("nodes") or [e.get("excluded")] if n]
            elif kind in RUN_ENDS:
                ended = str(kind)
        return cls(requeues, crash, hang, excludes, tuple(dict.fromkeys(excluded)), ended)


@dataclass(frozen=True)
class Budgets:
    max_requeues: int
    max_failure_retries: int
    max_node_excludes: int
    max_hang_retries: int = 3


@dataclass(frozen=True)
class Decision:
    action: Action
    cause: str | None  # finished -> None; else the cause kept all the way to `status`
    reason: str  # one line, the user's words
    exclude: tuple[str, ...] = ()
    counts_as: str | None = None  # the budget this continuation spends: requeue | crash | hang | node

    @property
    def event(self) -> str:
        """The ledger event that records this decision."""
        return {
            Action.FINISH: FINISHED,
            Action.CONTINUE: REQUEUED,
            Action.EXCLUDE: REQUEUED,
            Action.END: CANCELLED if self.cause == "cancelled" else ENDED,
            Action.FAIL: FAILED,
            Action.WITHDRAW: HELD,
        }[self.action]


def decide(facts: Facts, history: History, budgets: Budgets, *, can_exclude_nodes: bool) -> Decision:
    """The one decision after an attempt (see the module docstring)."""
    if facts.data_error is not None:
        return Decision(Action.FAIL, "data", f"bad training data: {facts.data_error}")
    if facts.failed_nodes:
        return _node_failure(facts, history, budgets, can_exclude_nodes)
    if facts.cancelled:
        step = facts.outcome.step if facts.outcome is not None else None
        saved = f" after step {step}" if step is not None and facts.outcome.status == "stopped" else ""  # type: ignore[union-attr]
        return Decision(Action.END, "cancelled", f"cancelled{saved}; never continued")
    out = facts.outcome
    if facts.hang is not None and (out is None or out.status != "finished"):
        return _hang(facts, history, budgets, can_exclude_nodes)
    if out is None and facts.interrupted in STOP_CAUSES:
        return _within(
            str(facts.interrupted),
            f"the {facts.interrupted} came before the attempt could save; it resumes from its last checkpoint",
            used=history.requeues,
            budget=budgets.max_requeues,
            what="requeues",
        )
    if out is None or (out.status == "failed" and out.cause == "crash"):
        error = (out.error if out is not None else None) or (
            f"torchrun exited with {facts.returncode} and the trainer left no outcome"
        )
        return _within(
            "crash",
            error,
            used=history.crash_retries,
            budget=budgets.max_failure_retries,
            what="failure retries",
        )
    if out.status == "finished":
        return Decision(Action.FINISH, None, f"finished at step {out.step}")
    if out.status == "failed":
        # The run's own verdict (non-finite steps, incompatible checkpoint, bad data): the same code
        # on the same data would fail again, so it is never retried.
        cause = out.cause if out.cause in ("data", "training") else "training"
        return Decision(Action.FAIL, cause, out.error or "the trainer failed")
    cause = out.cause or "user"
    if cause == "user" and not facts.continue_requested:
        return Decision(
            Action.END, "user", f"stopped by the user after step {out.step}; resume with submit --resume"
        )
    return _within(
        cause,
        f"stopped after step {out.step} ({cause})",
        used=history.requeues,
        budget=budgets.max_requeues,
        what="requeues",
    )


def _within(cause: str, reason: str, *, used: int, budget: int, what: str) -> Decision:
    if used >= budget:
        return Decision(Action.FAIL, cause, f"{reason}; {used} {what} used of {budget}")
    counts = "crash" if cause == "crash" else "requeue"
    return Decision(Action.CONTINUE, cause, reason, counts_as=counts)


def _hang(facts: Facts, history: History, budgets: Budgets, can_exclude: bool) -> Decision:
    """A hang: the workers were stopped without a save, so the run continues from its last
    checkpoint, within its own budget; off the hung node where the scheduler can say so."""
    what = facts.hang or "a rank stopped making progress"
    if facts.user_stop and not facts.continue_requested:
        return Decision(Action.END, "hang", f"{what}; stopped by the user: resume with submit --resume")
    if history.hang_retries >= budgets.max_hang_retries:
        return Decision(
            Action.FAIL,
            "hang",
            f"{what}; {history.hang_retries} hang retries used of {budgets.max_hang_retries}",
        )
    node = facts.hang_node
    if node is not None and can_exclude:
        return Decision(
            Action.EXCLUDE,
            "hang",
            f"{what}; continuing from the last checkpoint without {node}",
            exclude=tuple(sorted({*history.excluded, node})),
            counts_as="hang",
        )
    return Decision(Action.CONTINUE, "hang", f"{what}; continuing from the last checkpoint", counts_as="hang")


def _node_failure(facts: Facts, history: History, budgets: Budgets, can_exclude: bool) -> Decision:
    nodes = tuple(sorted(set(facts.failed_nodes)))
    what = "; ".join(f"{n}: {facts.node_problems.get(n, 'failed its node check')}" for n in nodes)
    if not can_exclude:
        return Decision(
            Action.FAIL,
            "node_failure",
            f"{what}; this scheduler cannot keep a continuation off a node, so the run stops here "
            "(fix or drain the node, then submit --resume)",
        )
    if history.node_excludes >= budgets.max_node_excludes:
        return Decision(
            Action.FAIL,
            "node_failure",
            f"{what}; {history.node_excludes} node exclusions used of {budgets.max_node_excludes}",
        )
    return Decision(
        Action.EXCLUDE,
        "node_failure",
        f"{what}; continuing without {', '.join(nodes)}",
        exclude=tuple(sorted({*history.excluded, *nodes})),
        counts_as="node",
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
