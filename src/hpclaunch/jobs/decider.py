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
from typing import Any

from ..config import RunConfig
from ..fsutil import retry_transient
from ..rundir import (
    CANCELLED,
    HANG,
    NODE_REPLACED,
    STARTED,
    Heartbeat,
    JobPlan,
    Ledger,
    LockHolder,
    RunLock,
    RunPaths,
)
from ..rundir.control import take_user_stop
from ..rundir.env import FOREGROUND_VAR
from ..rundir.lock import HEARTBEAT_EVERY_S
from ..rundir.outcome import AttemptOutcome, attempt_outcome
from ..rundir.paths import newest_checkpoint_step
from ..schedulers.base import NodeContext, Scheduler
from .agent_records import decision_fields
from .allocation import BEAT_S, POLL_S, REPORT_GRACE_S, Allocation, DecisionRecord, Roster, node_ranks
from .attribution import Suspicion, suspect
from .carry_out import cancelled_meanwhile, carry_out
from .decide import Action, Budgets, Decision, Facts, History, decide
from .node_checks import Verdicts
from .stop_relay import StopRelay
from .watchdog import Verdict, startup_hang


def started_at(events: list[dict[str, Any]], attempt: str) -> float:
    """When ``attempt`` started (its ``started`` event), 0 when the ledger has none."""
    for e in events:
        if e.get("event") == STARTED and e.get("attempt") == attempt:
            return float(e.get("ts") or 0)
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

    def __init__(
        self,
        paths: RunPaths,
        plan: JobPlan,
        cfg: RunConfig,
        ctx: NodeContext,
        scheduler: Scheduler,
        *,
        alloc: Allocation,
        relay: StopRelay,
        ledger: Ledger,
    ) -> None:
        self.paths = paths
        self.plan = plan
        self.cfg = cfg
        self.ctx = ctx
        self.scheduler = scheduler
        self.alloc = alloc
        self.relay = relay
        self.ledger = ledger
        self.lock = RunLock(paths)
        self.holder: LockHolder | None = None  # the run lock, once admitted or taken over
        self.beat_every_s = HEARTBEAT_EVERY_S
        self._beat: Heartbeat | None = None  # the lock's heartbeat, once this agent took the role over
        self.leads = ctx.is_head  # node 0 decides at first; the role moves (``follow``)
        self.outcome: AttemptOutcome | None = None  # the trainer's, once the attempt is decided
        self.newest_checkpoint: int | None = None  # at the last decision (its `checkpoint` field)
        self._next_look = 0.0  # when this agent next looks whether the decider still beats

    @property
    def attempt(self) -> str:
        return self.ctx.attempt

    def next_attempt(self, ctx: NodeContext, ledger: Ledger) -> None:
        """The agent restarted in place: the next attempt's context and ledger."""
        self.ctx, self.ledger = ctx, ledger
        self.outcome = None

    # ---- the role --------------------------------------------------------------------------------

    def gone(self, roster: Roster, every_s: float = BEAT_S) -> bool:
        """The deciding agent stopped beating and this agent is next in roster order (looked at once
        per ``every_s``: one small read of the decider's file; ``LOOK_S`` while an attempt runs,
        where the decider's death also breaks the ranks' collectives, once per beat otherwise)."""
        now = time.monotonic()
        if now < self._next_look:
            return False
        self._next_look = now + every_s
        return self.alloc.decider(roster) == self.ctx.hostname

    def follow(self, roster: Roster) -> None:
        """The roster changed: the role goes to its first live agent (a node the roster left, or a
        dead one, hands it on; the next takes it, with the run lock)."""
        mine = self.alloc.decider(roster) == self.ctx.hostname
        if mine and not self.leads:
            self.take_over()
        elif not mine and self.leads:
            self.leads = False
        self.relay.lead = self.leads

    def take_over(self) -> None:
        """The deciding agent is gone (or its node left the roster): this one decides from now on
        (and holds the run's lock)."""
        self.leads = True
        self.relay.lead = True
        print(
            f"hpclaunch: node {self.ctx.hostname} decides from now on (the deciding agent is gone or "
            "its node left the roster)",
            file=sys.stderr,
            flush=True,
        )
        with contextlib.suppress(OSError):
            self.holder = self.lock.adopt(job_id=self.ctx.job_id, role="agent")
        if self.holder is not None and self._beat is None:
            # (node 0's agent beats the lock it was admitted with; one that takes the role over
            # beats the lock it adopted, or the lock goes stale and another submission could take
            # the run while this allocation still trains it)
            self._beat = Heartbeat(self.lock, self.holder, every_s=self.beat_every_s).__enter__()

    def close(self) -> None:
        """Stop the lock's heartbeat this agent started when it took the role over."""
        if self._beat is not None:
            self._beat.__exit__(None, None, None)
            self._beat = None

    def await_decision(self, roster: Roster) -> DecisionRecord | None:
        """The decision on this attempt as the decider published it, or None when this agent
        decides (it does, or it took the role over while it waited)."""
        while not self.leads:
            published = self.alloc.decision(self.attempt)
            if published is not None:
                return published
            self.relay.handle_signals()
            if self.gone(roster):
                self.take_over()
                break
            time.sleep(POLL_S)
        return None

    # ---- deciding --------------------------------------------------------------------------------

    def after_checks(self, verdicts: Verdicts) -> Decision:
        """A node failed its checks (or the data did): what the run does instead of this attempt."""
        user = take_user_stop(self.paths, self.attempt)
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
            e.get("event") == CANCELLED and (e.get("ts") or 0) >= started_at(events, self.attempt)
            for e in events
        )
        outcome, read_error = self.read_outcome()
        self.outcome = outcome
        if hang is None:  # the smoke test may have named ranks that never reached it
            hang = startup_hang(
                self.paths, self.attempt, outcome, window_s=self.cfg.preflight.smoke_timeout_s
            )
            if hang is not None:
                self.ledger.append(HANG, **hang.ledger_fields())
        if hang is None and stuck:
            hang = Verdict.stuck(self.attempt, stuck, REPORT_GRACE_S)
            self.ledger.append(HANG, **hang.ledger_fields())
        blamed = self.suspect(roster) if outcome is None or outcome.status == "failed" else None
        self.newest_checkpoint = newest_checkpoint_step(self.paths)
        # Taken now (atomically): a request written after this moment is the next attempt's.
        user = take_user_stop(self.paths, self.attempt)
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
            spares=tuple(h for h in roster.spares if self.alloc.alive(h)),
            in_place_ok=in_place_ok(
                self.plan,
                stopping=self.relay.stop_cause is not None or self.relay.cancelled,
                end_time=self.ctx.end_time,
                now=time.time(),
            ),
        )
        return self.decision(facts, events)

    def suspect(self, roster: Roster) -> Suspicion | None:
        """The node this attempt's crash is pinned on, if the evidence names one (``attribution``)."""
        expect = node_ranks(self.ctx.hosts, roster.training)
        reports = self.alloc.reports(self.attempt, expect)
        logs = {h: self.paths.node_log(self.attempt, r) for r, h in expect.items()}
        return suspect(reports, logs)

    def read_outcome(self) -> tuple[AttemptOutcome | None, str | None]:
        """The trainer's outcome, read again while the filesystem says "not now" (EIO, ESTALE): a
        shared filesystem's hiccup must not make a finished run look like a crash."""
        try:
            return retry_transient(lambda: attempt_outcome(self.paths, self.attempt)), None
        except OSError as e:
            return None, f"{self.paths.outcome_file(self.attempt)}: {e.strerror or e}"

    def decision(self, facts: Facts, events: list[dict[str, Any]] | None = None) -> Decision:
        history = History.from_events(events if events is not None else self.ledger.events())
        return decide(
            facts, history, Budgets.from_plan(self.plan), can_exclude_nodes=self.scheduler.can_exclude_nodes
        )

    # ---- one decision for the whole allocation ---------------------------------------------------

    def publish(self, decision: Decision, roster: Roster) -> DecisionRecord:
        """Record the decision and tell every agent of the allocation (exactly one decision per
        attempt: a second decider's ``publish`` fails and it follows the first)."""
        record: DecisionRecord = {
            "attempt": self.attempt,
            "action": decision.action.value,
            "cause": decision.cause.value if decision.cause else None,
            "in_place": decision.in_place,
            "by": self.ctx.hostname,
        }
        if decision.in_place:
            record["next"] = f"{self.ctx.allocation}.{self.ctx.in_place + 1}"
            record["roster"] = roster.replaced(decision.replace).to_json()
        if not self.alloc.publish(self.attempt, record):
            other = self.alloc.decision(self.attempt)
            if other is not None:
                return other
        if decision.in_place:
            for bad, spare in decision.replace:
                self.ledger.append(NODE_REPLACED, nodes=[bad], spare=spare, reason=decision.reason)
            self.record(decision, next_attempt=record["next"], roster=record["roster"])
            return record
        return {**record, "exit_code": self.carry_out(decision)}

    def carry_out(self, decision: Decision) -> int:
        """Do what ``decision`` says through the scheduler; record it; the agent's exit code."""
        return carry_out(
            decision,
            scheduler=self.scheduler,
            plan=self.plan,
            paths=self.paths,
            ctx=self.ctx,
            ledger=self.ledger,
            recheck=self.unless_cancelled_meanwhile,
            record=self.record,
            release=self.release_lock,
        )

    def record(
        self,
        decision: Decision,
        *,
        job_id: str | None = None,
        by: str = "agent",
        note: str = "",
        ledger: Ledger | None = None,
        **extra: Any,
    ) -> None:
        """Append ``decision`` to the ledger (``ledger``: another attempt's, when this one decides
        for an attempt that could not) and say it on stderr."""
        fields = decision_fields(
            decision,
            scheduler=self.ctx.scheduler,
            can_exclude_nodes=self.scheduler.can_exclude_nodes,
            step=self.outcome.step if self.outcome is not None else None,
            newest_checkpoint=self.newest_checkpoint,
            job_id=job_id,
            by=by,
            note=note,
        )
        fields.update(extra)
        written = ledger or self.ledger
        written.append(decision.event, **fields)
        line = f"hpclaunch: {decision.action.value}: {decision.reason}"
        if not (_in_the_foreground() and decision.action in (Action.FINISH, Action.END, Action.FAIL)):
            print(line, file=sys.stderr, flush=True)  # (a foreground train says the last word itself)
        # The attempt's own log says how it ended: `hpclaunch logs` needs no scheduler's file.
        with contextlib.suppress(OSError):
            log = self.paths.node_log(written.attempt or self.ctx.attempt, self.ctx.node_rank)
            if log.parent.is_dir():
                with open(log, "a") as f:
                    f.write(f"# {line}\n")

    def release_lock(self, next_job: str | None) -> None:
        """Hand the lock to the job that continues the run, or release it when the run stops here."""
        if self.holder is None:
            return
        with contextlib.suppress(OSError):
            if next_job is not None and next_job != "":
                self.lock.hand_over(self.holder, next_job)
            else:
                self.lock.release(self.holder)

    def unless_cancelled_meanwhile(self, decision: Decision) -> Decision:
        """The decision again right before the scheduler is asked: the SIGTERM of a cancellation
        (scancel, qdel) is read again here, and so is the ledger (``hpclaunch cancel``)."""
        if decision.action not in (Action.CONTINUE, Action.EXCLUDE):
            return decision
        if self.cfg.testing.pause_before_continue_s:
            time.sleep(self.cfg.testing.pause_before_continue_s)
        self.relay.handle_signals()
        events = self.ledger.events()
        return cancelled_meanwhile(
            decision,
            signalled=self.relay.cancelled,
            events=events,
            started_at=started_at(events, self.attempt),
        )
