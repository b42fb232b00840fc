"""The one decision per attempt for the whole allocation, made by the agent that holds the
decider's role (``decider_role``: who decides, its lock and epoch, taking the role over).

The decider decides after the node checks (when a node failed them) and after every attempt: it
gathers the facts (the trainer's outcome, the reports, a hang, a cancel, the node a crash is pinned
on, whether the allocation can carry another attempt), asks ``decide`` (pure), publishes the
decision to every agent (``Allocation.publish``: exactly one per attempt) and, when the run goes on
through the scheduler, carries it out (``carry_out``). The other agents wait for the published
decision (``DeciderRole.await_decision``); a decision whose decider was deposed is recorded or
completed by the one that deposed it (``jobs.fenced``).

The agent tells the decider what changes between attempts: the roster with each call, the context
and the ledger at each attempt restarted in place (``DeciderRole.next_attempt``). Waiting for the
reports, and watching the attempt meanwhile, stays the agent's (``NodeAgent._await_reports``).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from typing import Any, cast

from ..errors import HpclaunchError
from ..fsutil import create_exclusive, retry_patiently
from ..rundir import NODE_REPLACED, Ledger
from ..rundir.env import FOREGROUND_VAR
from ..rundir.events import Event
from ..rundir.outcome import reached_step
from . import attempt_facts
from .agent_records import decision_fields, scheduler_note
from .allocation import DecisionRecord, Roster
from .attempt_facts import started_at
from .carry_out import (
    cancelled_meanwhile,
    carry_out,
    leave_to_rescue,
    read_carried,
    start_held,
    withdraw_stranded,
)
from .decider_role import DeciderRole
from .decision_rules import Action, Budgets, Decision, Facts, History, decide
from .fenced import Deposed, as_decision, decision_record, recorded
from .node_checks import Verdicts, read_standing
from .node_run import NodeRun
from .stop_relay import StopRelay
from .watchdog import Verdict


def _in_the_foreground() -> bool:
    return os.environ.get(FOREGROUND_VAR) == "1"


class Decider:
    """One attempt's decision, made while this agent holds the role (``role``): the facts gathered
    after the checks or after the attempt, the decision published to every agent, and carried out
    through the scheduler and recorded (or, made by a decider deposed meanwhile, followed,
    recorded or completed here)."""

    def __init__(self, role: DeciderRole) -> None:
        self.role = role
        self.newest_checkpoint: int | None = None  # at the last decision (its `checkpoint` field)
        self.reached_step: int | None = None  # the step the decided attempt reached (its `step`)
        self.followed: DecisionRecord | None = None  # the last in-place decision followed
        role.taken_over = self._taken_over

    @property
    def node(self) -> NodeRun:
        return self.role.node  # this attempt's

    @property
    def relay(self) -> StopRelay:
        return self.role.relay

    @property
    def ledger(self) -> Ledger:
        return self.node.ledger  # this attempt's

    def next_attempt(self) -> None:
        """The agent restarted in place (the role has the next attempt's node): nothing decided yet."""
        self.reached_step = None

    def _taken_over(self) -> None:
        """This agent took the role over: the last decision it followed, perhaps recorded by nobody."""
        if self.followed is not None:
            self.record_followed(self.followed)

    # ---- deciding --------------------------------------------------------------------------------

    def after_checks(self, verdicts: Verdicts) -> Decision:
        """A node failed its checks (or the data did): what the run does instead of this attempt."""
        return self.decision(attempt_facts.after_checks(self.node, verdicts))

    def after_attempt(
        self,
        returncode: int,
        roster: Roster,
        *,
        dead: tuple[str, ...] = (),
        stuck: tuple[str, ...] = (),
        hang: Verdict | None = None,
    ) -> Decision:
        """The decision on this attempt, from this node's ``returncode``, the training nodes that
        did not report (``dead``, ``stuck``) and the watchdog's ``hang`` verdict (``attempt_facts``)."""
        facts, events = attempt_facts.after_attempt(
            self.node, self.relay, returncode, roster, dead=dead, stuck=stuck, hang=hang
        )
        self.newest_checkpoint = facts.newest_checkpoint
        self.reached_step = reached_step(self.node.paths, self.node.attempt, facts.outcome)
        return self.decision(facts, events)

    def decision(self, facts: Facts, events: list[Event] | None = None) -> Decision:
        history = History.from_events(events if events is not None else self.ledger.events())
        return decide(
            facts,
            history,
            Budgets.from_plan(self.node.plan),
            can_exclude_nodes=self.node.scheduler.can_exclude_nodes,
        )

    # ---- one decision for the whole allocation ---------------------------------------------------

    def publish(self, decision: Decision, roster: Roster) -> DecisionRecord:
        """Record the decision and tell every agent of the allocation: exactly one decision per
        attempt (``decision.json`` is created exclusively), made under this decider's epoch. A
        decider deposed meanwhile follows whoever decides now; one that loses the race follows the
        decision that stands, and carries it out when its publisher was deposed (``jobs.fenced``)."""
        epoch = self.role.epoch
        nxt = f"{self.node.ctx.allocation}.{self.node.ctx.in_place + 1}"
        record = decision_record(
            decision,
            attempt=self.node.attempt,
            by=self.node.ctx.hostname,
            epoch=epoch,
            roster=roster,
            next_attempt=nxt,
            step=self.reached_step,
        )
        if not self.role.fenced():
            self.role.step_down("publish its decision")
            again = self.role.await_decision(roster)  # (None: the role came back here; decide again)
            return again if again is not None else self.publish(decision, roster)
        if not self.node.alloc.publish(self.node.attempt, record):
            other = self.wait_published()
            if other.get("nonce") != record["nonce"]:
                return self.follow_published(other, epoch)
        if decision.in_place:
            for bad, spare in decision.replace:
                self.ledger.append(NODE_REPLACED, nodes=[bad], spare=spare, reason=decision.reason)
            # Deposed right here, every agent still follows it: the decider that deposed this one
            # records it (``record_followed``), so it is recorded once and the attempt ends.
            with contextlib.suppress(Deposed):
                self.record_in_place(decision, record)
            return record
        return {**record, "exit_code": self.carry_out(decision)}

    def record_in_place(self, decision: Decision, published: DecisionRecord) -> None:
        """Record an in-place decision, once whoever records it: the first to create the attempt's
        ``recorded`` marker (its publisher, or the decider that deposed it) appends the record."""
        if not self.role.fenced():
            raise Deposed(f"record {decision.action.value}")
        marker = self.node.paths.attempt_dir(published["attempt"]) / "recorded"
        if not retry_patiently(lambda: create_exclusive(marker, published.get("nonce", ""))):
            return  # (recorded already)
        ledger = (
            self.ledger
            if published["attempt"] == self.node.attempt
            else self._ledger_of(published["attempt"])
        )
        # (after the marker the record is this agent's to make, deposed meanwhile or not: a fact
        # of the attempt, written once)
        self.record(
            decision,
            next_attempt=published["next"],
            roster=published["roster"],
            ledger=ledger,
            **_published_step(published),
            note=""
            if published.get("by") == self.node.ctx.hostname
            else f"decided by {published['by']} (deposed)",
            fence=False,
        )

    def record_followed(self, published: DecisionRecord) -> None:
        """A published in-place decision this agent follows: when this agent decides now and the
        decision's publisher held an older epoch (it was deposed, perhaps before it recorded it),
        the record is made here unless it exists (``record_in_place``'s marker)."""
        self.followed = published if published.get("in_place") else None
        if self.followed is None or not self.role.leads or self.role.holder is None:
            return
        if int(published.get("epoch") or 0) >= self.role.epoch:
            return  # (its publisher decides still: it records it)
        with contextlib.suppress(Deposed, OSError):
            self.record_in_place(as_decision(published), published)

    def _ledger_of(self, attempt: str) -> Ledger:
        return Ledger(self.node.paths, role="agent", attempt=attempt, node=self.node.ctx.node_rank)

    def wait_published(self) -> DecisionRecord:
        """The decision that stands on this attempt (it exists: this decider's publication lost to
        it), once it can be read."""
        data = read_standing(self.node.alloc.decision_file(self.node.attempt))
        return cast(DecisionRecord, data)  # (as ``Allocation.publish`` wrote it)

    def follow_published(self, published: DecisionRecord, epoch: int) -> DecisionRecord:
        """Another decider's decision stands. When it was made under an older epoch than this
        decider's (its publisher stalled and was deposed before it carried it out) and goes through
        the scheduler, this decider carries it out (``complete``); else it follows."""
        theirs = int(published.get("epoch") or 0)
        if theirs > epoch:
            self.role.step_down("decide this attempt")  # (its decider claimed the role after this one)
        if published.get("in_place"):
            self.record_followed(published)
            return published
        if theirs >= epoch or not self.role.fenced():
            return published
        return {**published, "exit_code": self.complete(published)}

    def complete(self, published: DecisionRecord) -> int:
        """Carry out a decision that its deposed decider published but did not carry out; when the
        ledger records it carried out already, only the lock's hand-over is left (to the job that
        the record names)."""
        decision = as_decision(published)
        self.reached_step = published.get("step", self.reached_step)  # (its publisher's, recorded here)
        done = recorded(self.ledger.events(), self.node.attempt)
        print(
            f"hpclaunch: node {self.node.ctx.hostname} completes the decision of {published['by']} "
            f"(deposed): {decision.action.value}, {'handing the lock on' if done else 'carrying it out'}",
            file=sys.stderr,
            flush=True,
        )
        if done is None:
            carried = read_carried(self.node)
            if carried is None:
                return self.carry_out(decision)
            # Its scheduler call was made (it was deposed before the record): recorded here, never
            # asked again (L2: a second requeue of the requeued job failed and was recorded FAILED).
            try:
                self.record(
                    decision, job_id=carried.job_id, by=carried.by, note=f"carried out by {published['by']}"
                )
            except Deposed as e:
                self.role.step_down(e.what)
                return 0
            self.role.release_lock(carried.job_id)
            if carried.held:
                stranded = start_held(self.node, carried.job_id)
                if stranded is not None:
                    withdraw_stranded(self.node, decision, carried.job_id, stranded)
                    return 1
            return carried.exit_code
        job = done.job_id if decision.action in (Action.CONTINUE, Action.EXCLUDE) else None
        self.role.release_lock(str(job) if job else None)
        return 0

    def carry_out(self, decision: Decision) -> int:
        """Do what ``decision`` says through the scheduler; record it; the agent's exit code. A
        decider deposed on the way stops there: it records nothing more, withdraws a job its last
        scheduler call made, and leaves the run to the decider that deposed it."""
        try:
            return carry_out(
                decision,
                self.node,
                recheck=self.unless_cancelled_meanwhile,
                record=self.record,
                release=self.role.release_lock,
                leave=lambda decision, error: leave_to_rescue(
                    self.node, decision, error, fenced=self.role.fenced, epoch=self.role.epoch
                ),
            )
        except Deposed as e:
            self.role.step_down(e.what)
            # A job its call made is withdrawn when the decider that deposed this one continued the
            # run with another; while none is recorded, that decider finds this call's fact
            # (``carry_out.note_carried``) and records it instead of calling again.
            done = recorded(self.ledger.events(), self.node.attempt)
            theirs = str(done.job_id) if done is not None and done.job_id else None
            if e.job_id and e.job_id != self.node.ctx.job_id and theirs is not None and theirs != e.job_id:
                with contextlib.suppress(HpclaunchError, OSError):
                    self.node.scheduler.cancel(self.node.paths, e.job_id)
                    print(f"hpclaunch: withdrew job {e.job_id}", file=sys.stderr, flush=True)
            return 0

    def record(
        self,
        decision: Decision,
        *,
        job_id: str | None = None,
        by: str = "agent",
        note: str = "",
        ledger: Ledger | None = None,
        fence: bool = True,
        **extra: Any,
    ) -> None:
        """Append ``decision`` to the ledger (``ledger``: another attempt's, when this one decides
        for an attempt that could not) and say it on stderr."""
        missing = scheduler_note(
            decision,
            scheduler=self.node.ctx.scheduler,
            can_exclude_nodes=self.node.scheduler.can_exclude_nodes,
        )
        fields = decision_fields(
            decision,
            step=self.reached_step,
            newest_checkpoint=self.newest_checkpoint,
            job_id=job_id,
            by=by,
            note=missing or note,
        )
        fields.update(extra)
        if fence and not self.role.fenced():
            raise Deposed(f"record {decision.action.value}", job_id)
        written = ledger or self.ledger
        written.append(decision.event, **fields)
        line = f"hpclaunch: {decision.action.value}: {decision.reason}"
        if not (_in_the_foreground() and decision.action in (Action.FINISH, Action.END, Action.FAIL)):
            print(line, file=sys.stderr, flush=True)  # (a foreground train says the last word itself)
        # The attempt's own log says how it ended: `hpclaunch logs` needs no scheduler's file.
        with contextlib.suppress(OSError):
            log = self.node.paths.node_log(written.attempt or self.node.ctx.attempt, self.node.ctx.node_rank)
            if log.parent.is_dir():
                with open(log, "a") as f:
                    f.write(f"# {line}\n")

    def unless_cancelled_meanwhile(self, decision: Decision) -> Decision:
        """The decision again right before the scheduler is asked: the SIGTERM of a cancellation
        (scancel, qdel) is read again here, and so is the ledger (``hpclaunch cancel``)."""
        if not self.role.fenced():
            raise Deposed(f"{decision.action.value} through the scheduler")
        if decision.action not in (Action.CONTINUE, Action.EXCLUDE):
            return decision
        if self.node.plan.agent.testing.pause_before_continue_s:
            time.sleep(self.node.plan.agent.testing.pause_before_continue_s)
        self.relay.handle_signals()
        events = self.ledger.events()
        return cancelled_meanwhile(
            decision,
            signalled=self.relay.cancelled,
            events=events,
            started_at=started_at(events, self.node.attempt),
        )


def _published_step(published: DecisionRecord) -> dict[str, Any]:
    """The step its publisher's record would have carried (this agent did not decide the attempt)."""
    step = published.get("step")
    return {"step": step} if step is not None else {}
