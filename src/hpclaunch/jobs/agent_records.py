"""What a node agent records about an attempt: its start, and the decision on it (one place for the
fields every reader of the ledger relies on: status, accounting, report, the next decision).

Pure: the fields are computed here, appended by the agent (``NodeAgent._record``).
"""

from __future__ import annotations

from typing import Any, TypedDict

from ..rundir import JobPlan
from ..rundir.attempt_records import RosterJSON
from ..rundir.cause import Cause
from ..schedulers.protocol import NodeContext
from .allocation import Roster
from .decision_rules import Action, Decision


class _StartedRequired(TypedDict):
    scheduler: str
    job_id: str
    restart_count: int
    nodes: int
    hosts: list[str]
    world_size: int
    end_time: float | None
    clock: dict[str, float | None] | None  # AttemptClock.to_json()


class StartedFields(_StartedRequired, total=False):
    """The ``started`` event's fields (``rundir.events.Started`` reads them back)."""

    in_place: bool  # these three: an attempt restarted in place
    previous: str
    roster: RosterJSON | None


def started_fields(
    ctx: NodeContext, plan: JobPlan, *, roster: Roster | None = None, previous: str | None = None
) -> StartedFields:
    """The ``started`` event of an attempt (``previous``: the attempt it restarts in place, on
    ``roster``)."""
    fields: StartedFields = {
        "scheduler": ctx.scheduler,
        "job_id": ctx.job_id,
        "restart_count": ctx.restart_count,
        "nodes": ctx.num_nodes,
        "hosts": list(ctx.hosts),
        "world_size": plan.world_size,
        "end_time": ctx.end_time,
        "clock": ctx.clock.to_json() if ctx.clock is not None else None,
    }
    if previous is not None:
        fields["in_place"] = True
        fields["previous"] = previous
        fields["roster"] = roster.to_json() if roster else None
    return fields


def decision_fields(
    decision: Decision,
    *,
    step: int | None = None,
    newest_checkpoint: int | None = None,
    job_id: str | None = None,
    by: str = "agent",
    note: str = "",
) -> dict[str, Any]:
    """The fields of the event that records ``decision`` (``step``: the step the attempt reached;
    ``newest_checkpoint``: what a continuation resumes from; ``note``: ``scheduler_note`` first)."""
    fields = decision.ledger_fields()
    continues = decision.action in (Action.CONTINUE, Action.EXCLUDE)
    if step is not None:
        fields["step"] = step
    if job_id is not None:
        fields["job_id"] = job_id
    if continues:
        fields["by"] = by
        fields["in_place"] = decision.in_place
        if decision.counts_as:
            fields["counts_as"] = decision.counts_as
    if decision.replace:
        fields["replaced"] = dict(decision.replace)
    if decision.suspect:
        fields["suspect"] = decision.suspect
    if continues and newest_checkpoint is not None:
        fields["checkpoint"] = newest_checkpoint
    if note:
        fields["note"] = note
    return fields


def scheduler_note(decision: Decision, *, scheduler: str, can_exclude_nodes: bool) -> str | None:
    """What ``scheduler`` cannot do for ``decision`` (keep a continuation off a node), said in its
    record; None where nothing is missing."""
    if scheduler != "slurm" and decision.cause is Cause.NODE_FAILURE and decision.action is Action.FAIL:
        return f"{scheduler} cannot keep a continuation off a node"
    if (
        decision.cause is Cause.HANG
        and decision.action is Action.CONTINUE
        and not decision.in_place
        and not can_exclude_nodes
    ):
        return f"{scheduler} cannot keep a continuation off a node: it may run where it hung"
    return None
