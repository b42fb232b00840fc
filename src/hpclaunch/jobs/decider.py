"""The decider's role, as one node agent holds it: whether it decides (``leads``), taking the role
over, and the one decision per attempt for the whole allocation.

The role (``allocation``: the first live agent in roster order) moves: when the deciding agent stops
beating or its node leaves the roster, the next one takes it, with the run lock. Whoever holds it
decides after the node checks (when a node failed them) and after every attempt: it gathers the
facts (the trainer's outcome, the reports, a hang, a cancel, the node a crash is pinned on, whether
the allocation can carry another attempt), asks ``decide`` (pure), publishes the decision to every
agent (``Allocation.publish``: exactly one per attempt) and, when the run goes on through the
scheduler, carries it out (``carry_out``). The other agents wait for the published decision.

The agent tells the decider what changes between attempts: the roster with each call, the context
and the ledger at each attempt restarted in place (``next_attempt``). Waiting for the reports, and
watching the attempt meanwhile, stays the agent's (``NodeAgent._await_reports``).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from typing import Any, cast

from ..errors import HpclaunchError
from ..fsutil import create_exclusive, retry_patiently, retry_transient
from ..rundir import (
    HANG,
    NODE_REPLACED,
    Heartbeat,
    JobPlan,
    Ledger,
    LockHolder,
    RunLock,
)
from ..rundir.control import take_user_stop
from ..rundir.env import FOREGROUND_VAR
from ..rundir.events import Cancelled, Event, RescueSubmitted, Started, of_kind
from ..rundir.kinds import AGENT_ERROR
from ..rundir.lock import HEARTBEAT_EVERY_S
from ..rundir.outcome import AttemptOutcome, attempt_outcome
from ..rundir.paths import newest_checkpoint_step
from ..schedulers.base import NodeContext
from ..schedulers.rescue_job import waiting_rescues
from .agent_records import decision_fields
from .allocation import BEAT_S, POLL_S, REPORT_GRACE_S, DecisionRecord, Roster, node_ranks
from .attribution import Suspicion, suspect
from .carry_out import cancelled_meanwhile, carry_out, read_carried, start_held, withdraw_stranded
from .decision_rules import Action, Budgets, Decision, Facts, History, decide
from .fenced import Deposed, as_decision, decision_record, recorded
from .node_checks import StartBarrier, Verdicts, Word, read_standing
from .node_run import NodeRun
from .stop_relay import StopRelay
from .watchdog import Verdict, startup_hang


def started_at(events: list[Event], attempt: str) -> float:
    """When ``attempt`` started (its ``started`` event), 0 when the ledger has none."""
    for e in of_kind(events, Started):
        if e.attempt == attempt:
            return float(e.ts or 0)
    return 0.0


def in_place_ok(plan: JobPlan, *, stopping: bool, end_time: float | None, now: float) -> bool:
    """The allocation can carry another attempt: no stop under way (``stopping``), and time for a
    start-up and a stop save before the end (else the next attempt goes through the scheduler)."""
    if not plan.restart_in_place or stopping:
        return False
    if end_time is None:
        return True
    return end_time - now > max(60.0, 2 * plan.planned_stop_lead_s)


def _in_the_foreground() -> bool:
    return os.environ.get(FOREGROUND_VAR) == "1"


class Decider:
    """This agent's part in deciding: the role's flag and the run lock it holds, and the decisions
    it makes while it leads (after the checks, after each attempt), published and carried out."""

    def __init__(self, node: NodeRun, relay: StopRelay) -> None:
        self.node = node
        self.relay = relay
        self.lock = RunLock(node.paths)
        self.holder: LockHolder | None = None  # the run lock, once admitted or taken over
        self.beat_every_s = HEARTBEAT_EVERY_S
        self._beat: Heartbeat | None = None  # the lock's heartbeat, while this agent holds it
        self.leads = node.ctx.is_head  # node 0 decides at first; the role moves (``follow``)
        self.outcome: AttemptOutcome | None = None  # the trainer's, once the attempt is decided
        self.newest_checkpoint: int | None = None  # at the last decision (its `checkpoint` field)
        self._next_look = 0.0  # when this agent next looks whether the decider still beats
        self.followed: DecisionRecord | None = None  # the last in-place decision followed

    @property
    def attempt(self) -> str:
        return self.node.attempt

    @property
    def ctx(self) -> NodeContext:
        return self.node.ctx  # this attempt's

    @property
    def ledger(self) -> Ledger:
        return self.node.ledger  # this attempt's

    def next_attempt(self, node: NodeRun) -> None:
        """The agent restarted in place: the next attempt's context and ledger."""
        self.node = node
        self.outcome = None

    # ---- the role --------------------------------------------------------------------------------

    def gone(self, roster: Roster, every_s: float = BEAT_S) -> bool:
        """The deciding agent is gone and this agent is next in roster order: its connection ended
        (``links``: the first evidence, looked at every time), or its heartbeat stopped (looked at
        once per ``every_s``: one small read of the decider's file; ``LOOK_S`` while an attempt runs,
        once per beat otherwise)."""
        now = time.monotonic()
        ahead = (
            roster.nodes[: roster.nodes.index(self.ctx.hostname)] if self.ctx.hostname in roster.nodes else ()
        )
        if now < self._next_look and not any(self.node.alloc.known_dead(h) for h in ahead):
            return False  # (a connection that ended is looked at every time: it costs no read)
        self._next_look = now + every_s
        return self.node.alloc.decider(roster) == self.ctx.hostname

    def follow(self, roster: Roster) -> None:
        """The roster changed: the role goes to its first live agent (a node the roster left, or a
        dead one, hands it on; the next takes it, with the run lock). An agent whose turn it is
        again after it was deposed (it stalled past the window, another took the role, and now it
        is the first live agent again) claims the role anew: a role without the lock's epoch can
        write nothing."""
        mine = self.node.alloc.decider(roster) == self.ctx.hostname
        if mine and (not self.leads or not self.fenced()):
            self.take_over()
        elif not mine and self.leads:
            self.leads = False
        self.relay.lead = self.leads

    def take_over(self) -> bool:
        """The deciding agent is gone (or its node left the roster): this one decides from now on,
        when it claims the run lock's next epoch from its own job (``RunLock.take_role``). False:
        another agent claimed it first, or the lock has gone to another job; this one follows."""
        holder = None
        with contextlib.suppress(OSError):
            holder = self.lock.take_role(job_id=self.ctx.job_id)
        self.leads = self.relay.lead = holder is not None
        if holder is None:
            print(
                f"hpclaunch: node {self.ctx.hostname} does not take the decider's role: another agent "
                "claimed it first, or the run's lock has gone to another job",
                file=sys.stderr,
                flush=True,
            )
            return False
        print(
            f"hpclaunch: node {self.ctx.hostname} decides from now on (the deciding agent is gone or "
            f"its node left the roster; the run lock's epoch {holder.epoch})",
            file=sys.stderr,
            flush=True,
        )
        self.hold(holder)
        if self.followed is not None:  # (the last decision followed, perhaps recorded by nobody)
            self.record_followed(self.followed)
        return True

    def hold(self, holder: LockHolder | None) -> None:
        """This agent holds the run lock as ``holder`` (admitted, or the role taken over) and beats
        it (or the lock goes stale and another submission could take the run while this allocation
        still trains it)."""
        self.close()
        self.holder = holder
        if holder is not None:
            self._beat = Heartbeat(self.lock, holder, every_s=self.beat_every_s).__enter__()

    @property
    def lost_lock(self) -> bool:
        """The lock's heartbeat found the lock another's (``Heartbeat.lost``): deposed; no read."""
        return self._beat is not None and self._beat.lost

    def fenced(self) -> bool:
        """This decider's authority still holds: no later epoch of the run lock was claimed (it was
        not deposed while it stalled). Asked right before each write only the decider may make.
        Always true where it holds no lock (one node under the local controller or a foreground
        ``train``, which hold it: nobody else can decide there)."""
        if self.holder is None:
            return True
        if self.lost_lock:
            return False  # (its heartbeat found the lock another's: deposed, whatever a read says now)
        try:
            return self.lock.holds(self.holder)
        except OSError:
            return True  # cannot tell now: the exclusive files still keep one decision

    def step_down(self, what: str) -> None:
        """Deposed: another agent claimed the role while this one stalled; it follows from now on."""
        self.leads = self.relay.lead = False
        print(
            f"hpclaunch: node {self.ctx.hostname} was deposed as the decider (another agent took the "
            f"role while it stalled); it does not {what} and follows",
            file=sys.stderr,
            flush=True,
        )

    def announce(self, barrier: StartBarrier, *, go: bool, roster: Roster, reason: str) -> Word | None:
        """The start's word under this decider's epoch: None when it was deposed before it could say
        it (it follows from now on); else the word that stands (``go.json`` is created exclusively:
        a second decider's word, a deposed one's included, never replaces the first; ``Word.ours``
        says whether it is this one's)."""
        if not self.fenced():
            self.step_down("announce the start")
            return None
        return barrier.announce(
            go=go,
            reason="" if go else reason,
            roster=roster.to_json() if go else None,
            epoch=self.holder.epoch if self.holder is not None else 0,
        )

    def close(self) -> None:
        """Stop the lock's heartbeat this agent started."""
        if self._beat is not None:
            self._beat.__exit__(None, None, None)
            self._beat = None

    def await_decision(self, roster: Roster) -> DecisionRecord | None:
        """The decision on this attempt as the decider published it, or None when this agent
        decides (it does, or it took the role over while it waited)."""
        while not self.leads:
            published = self.node.alloc.decision(self.attempt)
            if published is not None:
                return published
            self.relay.handle_signals()
            if self.gone(roster) and self.take_over():
                break
            time.sleep(POLL_S)
        return None

    # ---- deciding --------------------------------------------------------------------------------

    def after_checks(self, verdicts: Verdicts) -> Decision:
        """A node failed its checks (or the data did): what the run does instead of this attempt."""
        user = take_user_stop(self.node.paths, self.attempt)
        facts = Facts(
            outcome=None,
            failed_nodes=tuple(verdicts.failed_nodes),
            node_problems=verdicts.failed_nodes,
            data_error=verdicts.data_error,
            user_stop=user is not None,
            continue_requested=user is not None and user.continue_,
        )
        return self.decision(facts)

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
        did not report (``dead``, ``stuck``) and the watchdog's ``hang`` verdict."""
        events = self.ledger.events()
        cancelled = self.relay.cancelled or any(
            (e.ts or 0) >= started_at(events, self.attempt) for e in of_kind(events, Cancelled)
        )
        outcome, read_error = self.read_outcome()
        self.outcome = outcome
        if hang is None:  # the smoke test may have named ranks that never reached it
            hang = startup_hang(
                self.node.paths, self.attempt, outcome, window_s=self.node.cfg.preflight.smoke_timeout_s
            )
            if hang is not None:
                self.ledger.append(HANG, **hang.ledger_fields())
        if hang is None and stuck:
            hang = Verdict.stuck(self.attempt, stuck, REPORT_GRACE_S)
            self.ledger.append(HANG, **hang.ledger_fields())
        blamed = self.suspect(roster) if outcome is None or outcome.status == "failed" else None
        self.newest_checkpoint = newest_checkpoint_step(self.node.paths)
        # Taken now (atomically): a request written after this moment is the next attempt's.
        user = take_user_stop(self.node.paths, self.attempt)
        facts = Facts(
            outcome=outcome,
            returncode=returncode,
            cancelled=cancelled,
            user_stop=user is not None,
            continue_requested=user is not None and user.continue_,
            hang=hang.reason if hang is not None else None,
            hang_node=hang.culprit_node if hang is not None else None,
            interrupted=self.relay.interrupted,
            read_error=read_error,
            dead_nodes=dead,
            suspect=blamed.node if blamed is not None else None,
            suspect_evidence=blamed.evidence if blamed is not None else "",
            suspect_certain=blamed is not None and blamed.certain,
            newest_checkpoint=self.newest_checkpoint,
            spares=tuple(h for h in roster.spares if self.node.alloc.alive(h)),
            in_place_ok=in_place_ok(
                self.node.plan,
                stopping=self.relay.stop_cause is not None or self.relay.cancelled,
                end_time=self.ctx.end_time,
                now=time.time(),
            ),
        )
        return self.decision(facts, events)

    def suspect(self, roster: Roster) -> Suspicion | None:
        """The node this attempt's crash is pinned on, if the evidence names one (``attribution``)."""
        expect = node_ranks(self.ctx.hosts, roster.training)
        reports = self.node.alloc.reports(self.attempt, expect)
        logs = {h: self.node.paths.node_log(self.attempt, r) for r, h in expect.items()}
        return suspect(reports, logs)

    def read_outcome(self) -> tuple[AttemptOutcome | None, str | None]:
        """The trainer's outcome, read again while the filesystem says "not now" (EIO, ESTALE): a
        shared filesystem's hiccup must not make a finished run look like a crash."""
        try:
            return retry_transient(lambda: attempt_outcome(self.node.paths, self.attempt)), None
        except OSError as e:
            return None, f"{self.node.paths.outcome_file(self.attempt)}: {e.strerror or e}"

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
        epoch = self.holder.epoch if self.holder is not None else 0
        nxt = f"{self.ctx.allocation}.{self.ctx.in_place + 1}"
        record = decision_record(
            decision, attempt=self.attempt, by=self.ctx.hostname, epoch=epoch, roster=roster, next_attempt=nxt
        )
        if not self.fenced():
            self.step_down("publish its decision")
            again = self.await_decision(roster)  # (None: the role came back here; decide again)
            return again if again is not None else self.publish(decision, roster)
        if not self.node.alloc.publish(self.attempt, record):
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
        if not self.fenced():
            raise Deposed(f"record {decision.action.value}")
        marker = self.node.paths.attempt_dir(published["attempt"]) / "recorded"
        if not retry_patiently(lambda: create_exclusive(marker, published.get("nonce", ""))):
            return  # (recorded already)
        ledger = (
            self.ledger if published["attempt"] == self.attempt else self._ledger_of(published["attempt"])
        )
        # (after the marker the record is this agent's to make, deposed meanwhile or not: a fact
        # of the attempt, written once)
        self.record(
            decision,
            next_attempt=published["next"],
            roster=published["roster"],
            ledger=ledger,
            note=""
            if published.get("by") == self.ctx.hostname
            else f"decided by {published['by']} (deposed)",
            fence=False,
        )

    def record_followed(self, published: DecisionRecord) -> None:
        """A published in-place decision this agent follows: when this agent decides now and the
        decision's publisher held an older epoch (it was deposed, perhaps before it recorded it),
        the record is made here unless it exists (``record_in_place``'s marker)."""
        self.followed = published if published.get("in_place") else None
        if self.followed is None or not self.leads or self.holder is None:
            return
        if int(published.get("epoch") or 0) >= self.holder.epoch:
            return  # (its publisher decides still: it records it)
        with contextlib.suppress(Deposed, OSError):
            self.record_in_place(as_decision(published), published)

    def _ledger_of(self, attempt: str) -> Ledger:
        return Ledger(self.node.paths, role="agent", attempt=attempt, node=self.ctx.node_rank)

    def wait_published(self) -> DecisionRecord:
        """The decision that stands on this attempt (it exists: this decider's publication lost to
        it), once it can be read."""
        data = read_standing(self.node.alloc.decision_file(self.attempt))
        return cast(DecisionRecord, data)  # (as ``Allocation.publish`` wrote it)

    def follow_published(self, published: DecisionRecord, epoch: int) -> DecisionRecord:
        """Another decider's decision stands. When it was made under an older epoch than this
        decider's (its publisher stalled and was deposed before it carried it out) and goes through
        the scheduler, this decider carries it out (``complete``); else it follows."""
        theirs = int(published.get("epoch") or 0)
        if theirs > epoch:
            self.step_down("decide this attempt")  # (its decider claimed the role after this one)
        if published.get("in_place"):
            self.record_followed(published)
            return published
        if theirs >= epoch or not self.fenced():
            return published
        return {**published, "exit_code": self.complete(published)}

    def complete(self, published: DecisionRecord) -> int:
        """Carry out a decision that its deposed decider published but did not carry out; when the
        ledger records it carried out already, only the lock's hand-over is left (to the job that
        the record names)."""
        decision = as_decision(published)
        done = recorded(self.ledger.events(), self.attempt)
        print(
            f"hpclaunch: node {self.ctx.hostname} completes the decision of {published['by']} "
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
                self.step_down(e.what)
                return 0
            self.release_lock(carried.job_id)
            if carried.held:
                stranded = start_held(self.node, carried.job_id)
                if stranded is not None:
                    withdraw_stranded(self.node, decision, carried.job_id, stranded)
                    return 1
            return carried.exit_code
        job = done.job_id if decision.action in (Action.CONTINUE, Action.EXCLUDE) else None
        self.release_lock(str(job) if job else None)
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
                release=self.release_lock,
                leave=self.leave_to_rescue,
            )
        except Deposed as e:
            self.step_down(e.what)
            # A job its call made is withdrawn when the decider that deposed this one continued the
            # run with another; while none is recorded, that decider finds this call's fact
            # (``carry_out.note_carried``) and records it instead of calling again.
            done = recorded(self.ledger.events(), self.attempt)
            theirs = str(done.job_id) if done is not None and done.job_id else None
            if e.job_id and e.job_id != self.ctx.job_id and theirs is not None and theirs != e.job_id:
                with contextlib.suppress(HpclaunchError, OSError):
                    self.node.scheduler.cancel(self.node.paths, e.job_id)
                    print(f"hpclaunch: withdrew job {e.job_id}", file=sys.stderr, flush=True)
            return 0

    def leave_to_rescue(self, decision: Decision, error: str) -> bool:
        """The scheduler kept refusing to continue the run: when a rescue job waits on this job
        (``schedulers.rescue_job``), the decision stays published and unrecorded, the lock this
        agent's, and the rescue carries it out once this job has ended (the agent exits 1: the job
        ends failed, which starts it). False when none waits."""
        events = self.ledger.events()
        waiting = set(waiting_rescues(events))
        ours = [e.rescue_job for e in of_kind(events, RescueSubmitted) if str(e.job_id) == self.ctx.job_id]
        rescue = next((r for r in reversed(ours) if r in waiting), None)
        if rescue is None or not self.fenced():
            return False
        if self.node.alloc.decision(self.attempt) is None:  # (decided after the checks: not published)
            epoch = self.holder.epoch if self.holder is not None else 0
            record = decision_record(
                decision,
                attempt=self.attempt,
                by=self.ctx.hostname,
                epoch=epoch,
                roster=Roster(()),
                next_attempt="",
            )
            self.node.alloc.publish(self.attempt, record)
        words = (
            f"continuing through the scheduler failed ({error}); the rescue job {rescue} continues the run "
            f"once job {self.ctx.job_id} has ended"
        )
        self.ledger.append(AGENT_ERROR, error=words)
        print(f"hpclaunch: {words}", file=sys.stderr, flush=True)
        return True

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
        fields = decision_fields(
            decision,
            scheduler=self.ctx.scheduler,
            can_exclude_nodes=self.node.scheduler.can_exclude_nodes,
            step=self.outcome.step if self.outcome is not None else None,
            newest_checkpoint=self.newest_checkpoint,
            job_id=job_id,
            by=by,
            note=note,
        )
        fields.update(extra)
        if fence and not self.fenced():
            raise Deposed(f"record {decision.action.value}", job_id)
        written = ledger or self.ledger
        written.append(decision.event, **fields)
        line = f"hpclaunch: {decision.action.value}: {decision.reason}"
        if not (_in_the_foreground() and decision.action in (Action.FINISH, Action.END, Action.FAIL)):
            print(line, file=sys.stderr, flush=True)  # (a foreground train says the last word itself)
        # The attempt's own log says how it ended: `hpclaunch logs` needs no scheduler's file.
        with contextlib.suppress(OSError):
            log = self.node.paths.node_log(written.attempt or self.ctx.attempt, self.ctx.node_rank)
            if log.parent.is_dir():
                with open(log, "a") as f:
                    f.write(f"# {line}\n")

    def release_lock(self, next_job: str | None) -> None:
        """Hand the lock to the job that continues the run, or release it when the run stops here."""
        if self.holder is None:
            return
        handed = True
        with contextlib.suppress(OSError):
            if next_job is not None and next_job != "":
                handed = self.lock.hand_over(self.holder, next_job)
            else:
                self.lock.release(self.holder)
        if not handed:
            print(
                f"hpclaunch: the run lock was not handed to job {next_job}: it is not this agent's any "
                "more (that job adopted it, or another agent took the decider's role)",
                file=sys.stderr,
                flush=True,
            )

    def unless_cancelled_meanwhile(self, decision: Decision) -> Decision:
        """The decision again right before the scheduler is asked: the SIGTERM of a cancellation
        (scancel, qdel) is read again here, and so is the ledger (``hpclaunch cancel``)."""
        if not self.fenced():
            raise Deposed(f"{decision.action.value} through the scheduler")
        if decision.action not in (Action.CONTINUE, Action.EXCLUDE):
            return decision
        if self.node.cfg.testing.pause_before_continue_s:
            time.sleep(self.node.cfg.testing.pause_before_continue_s)
        self.relay.handle_signals()
        events = self.ledger.events()
        return cancelled_meanwhile(
            decision,
            signalled=self.relay.cancelled,
            events=events,
            started_at=started_at(events, self.attempt),
        )
