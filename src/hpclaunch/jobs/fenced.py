"""What a decider writes under its authority, and what another decider makes of it.

A decider's authority is the run lock's epoch it claimed (``rundir.lock``): a decider that stalls
past ``DEAD_AFTER_S`` (a GC pause, a hung NFS client, SIGSTOP) is replaced by the next agent, which
claims the next epoch. Everything only the decider may write carries its epoch and lands
exclusively or after a check of the epoch (``DeciderRole.fenced``), so the deposed one, once it runs
again, can do no harm:

- ``go.json`` (the start's word and roster) and ``decision.json`` (the decision on an attempt) are
  created exclusively (``link()``): a second word or decision never replaces the first; whoever
  loses follows the one that stands, a deposed decider's included, so every agent follows one;
- its ledger records and its scheduler calls are made after a check of the epoch (``Deposed``:
  raised where it failed; a job it had just submitted is withdrawn);
- its hand-over of the lock claims the next epoch, which a deposed holder cannot.

A decision published by a decider that was deposed before it carried it out (it stalled between
the two) is carried out by the one that deposed it (``as_decision``), unless the ledger already
records it (``recorded``): then only the lock's hand-over is left to do.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable

from ..rundir.cause import Budget, Cause
from ..rundir.events import Cancelled, Decided, Ended, Event, Failed, Finished, Requeued
from .allocation import DecisionRecord, Roster
from .decision_rules import Action, Decision

_DECIDED = (Requeued, Finished, Failed, Ended, Cancelled)  # a hold is no decision carried out


class Deposed(Exception):
    """This decider's epoch is no longer the lock's: it writes nothing more. ``job_id``: a job its
    scheduler call had just made (to withdraw: the decider that deposed it continues the run)."""

    def __init__(self, what: str, job_id: str | None = None) -> None:
        super().__init__(what)
        self.what = what
        self.job_id = job_id


def decision_record(
    decision: Decision,
    *,
    attempt: str,
    by: str,
    epoch: int,
    roster: Roster,
    next_attempt: str,
    step: int | None = None,
) -> DecisionRecord:
    """``decision.json``: the decision, whose it is (host, epoch, a nonce to know one's own after a
    retried ``link()``), and what another decider needs to carry it out or record it as its
    publisher would have (the nodes replaced, the suspect, the step the attempt reached)."""
    record: DecisionRecord = {
        "attempt": attempt,
        "action": decision.action.value,
        "cause": decision.cause.value if decision.cause else None,
        "in_place": decision.in_place,
        "by": by,
        "epoch": epoch,
        "nonce": uuid.uuid4().hex,
        "reason": decision.reason,
    }
    if decision.exclude:
        record["exclude"] = list(decision.exclude)
    if decision.counts_as is not None:
        record["counts_as"] = decision.counts_as.value
    if decision.replace:
        record["replace"] = [list(pair) for pair in decision.replace]
    if decision.suspect:
        record["suspect"] = decision.suspect
    if step is not None:
        record["step"] = step
    if decision.in_place:
        record["next"] = next_attempt
        record["roster"] = roster.replaced(decision.replace).to_json()
    return record


def as_decision(record: DecisionRecord) -> Decision:
    """The published decision again (to carry out one through the scheduler, or to record an in-place
    one whose publisher was deposed before it could)."""
    return Decision(
        Action(record["action"]),
        Cause.parse_optional(record.get("cause")),
        str(record.get("reason") or f"{record['action']} (decided by {record['by']})"),
        exclude=tuple(record.get("exclude") or ()),
        counts_as=Budget.parse_optional(record.get("counts_as")),
        in_place=bool(record.get("in_place")),
        replace=tuple((str(bad), str(spare)) for bad, spare in record.get("replace") or ()),
        suspect=record.get("suspect"),
    )


def recorded(events: Iterable[Event], attempt: str) -> Decided | None:
    """The ledger's record of the decision on ``attempt`` (the last), or None: not carried out."""
    found = None
    for e in events:
        if isinstance(e, _DECIDED) and e.attempt == attempt:
            found = e
    return found
