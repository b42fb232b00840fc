"""The rescue: decides an attempt that the scheduler ended before any agent could, and continues the
run without a person (``python -m hpclaunch.jobs.rescue RUN_DIR JOB_ID``; torch-free).

The scheduler starts it only when ``JOB_ID`` ended in a failed state (``schedulers.rescue_job``). It
reads the ledger: when the latest attempt of that job has a decision recorded, or the run has
ended, it does nothing and says so. When an agent published a decision (``decision.json``) and died
carrying it out, the rescue carries that decision out. Otherwise it decides the attempt itself,
with ``decide`` like any agent, from what it can know: the trainer's outcome (a run that finished
just before the job died is finished), how the scheduler ended the job (a time limit, a deadline
or a preemption is not the batch host's fault: the run continues as that stop; OUT_OF_MEMORY is the
run's memory, a crash), an agent that recorded the error it left on (a filesystem error on the
batch host is not its node's death), a user's pending stop or a cancellation; and only when none
of these explains it, the batch host's node failure (and that of any host whose agent fell silent
well before the others), within ``max_node_excludes``.

The rescue's decision is published like an agent's (``decision.json``, created exclusively: an
agent's decision published meanwhile wins, and is the one carried out) and the lock taken from the
dead job claims its next epoch (``rundir.lock``). The continuation is submitted held, so that the
run's lock is handed to it and the attempt recorded decided before it can start, with its own
rescue; its release is tried a bounded number of times, and a continuation that cannot be released
is withdrawn and the run left resumable, saying why (never a held job that nothing starts).

The pure part, ``find``, is a function of the ledger's events, the agents' last heartbeats, the
scheduler's word for the job, the trainer's outcome and a published decision;
``tests/unit/test_rescue.py`` holds its rows.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from ..errors import HpclaunchError
from ..fsutil import create_exclusive, poll_json, retry_transient
from ..rundir import (
    NODE_EXCLUDED,
    RESCUE,
    AttemptOutcome,
    Ledger,
    LockHolder,
    RunLock,
    RunPaths,
    read_events,
    read_plan,
)
from ..rundir.cause import Cause
from ..rundir.control import take_user_stop
from ..rundir.events import AgentError, Cancelled, Event, Started, of_kind
from ..rundir.lock import liveness
from ..rundir.outcome import attempt_outcome, reached_step
from ..schedulers.registry import get_scheduler
from ..schedulers.rescue_job import leave_rescue, withdraw_rescues
from .allocation import DecisionRecord, Roster
from .decision_rules import RESUMABLE, Action, Budgets, Decision, Facts, History, decide, unended_attempt
from .fenced import as_decision, decision_record

# An agent whose heartbeat stopped this long before the allocation's last one was gone before the
# scheduler ended the job (its node died first); the others were ended with the job.
GONE_BEFORE_S = 5.0
SELF_VARS = ("SLURM_JOB_ID", "PBS_JOBID")
RELEASE_PAUSES_S = (2.0, 5.0, 10.0, 20.0)  # between the tries of the continuation's release


@dataclass(frozen=True)
class Finding:
    """What the rescue found: ``decision`` None means nothing to do, and ``reason`` says why."""

    reason: str
    attempt: str | None = None
    decision: Decision | None = None
    gone: tuple[str, ...] = ()


def job_attempts(events: Sequence[Event], job_id: str) -> list[str]:
    """The attempts that ``job_id`` ran, in order (in-place restarts included)."""
    keys = [e.attempt for e in of_kind(events, Started) if str(e.job_id) == job_id]
    return list(dict.fromkeys(k for k in keys if k))


def hosts_of(events: Sequence[Event], attempt: str) -> tuple[str, ...]:
    """The allocation's hosts, batch host first, as the attempt's node 0 recorded them."""
    for e in of_kind(events, Started):
        if e.attempt == attempt and e.hosts:
            return tuple(e.hosts)
    return ()


def gone_hosts(
    hosts: tuple[str, ...],
    beats: Mapping[str, float],
    reported: Iterable[str] = (),
    *,
    slack_s: float = GONE_BEFORE_S,
) -> tuple[str, ...]:
    """The hosts to leave out: the batch host (its batch script's death is what ends a job whose
    other nodes are kept with ``--no-kill``), and any host whose agent never reported the attempt
    and fell silent ``slack_s`` before the allocation's last heartbeat (gone first, not ended with
    the job; an agent that reported may have exited on its own, after a decision)."""
    if not hosts:
        return ()
    seen = [beats[h] for h in hosts if h in beats]
    last = max(seen) if seen else 0.0
    done = set(reported)
    early = [h for h in hosts[1:] if h not in done and h in beats and beats[h] < last - slack_s]
    return (hosts[0], *early)


def reported_hosts(paths: RunPaths, attempt: str) -> set[str]:
    """The hosts whose agents reported ``attempt`` (``jobs.allocation``'s ``node<r>.done.json``)."""
    hosts: set[str] = set()
    for path in paths.attempt_dir(attempt).glob("node*.done.json"):
        with contextlib.suppress(OSError, ValueError, AttributeError):
            hosts.add(str(json.loads(path.read_text()).get("host")))
    return hosts


# How the scheduler says a job ended that is no fault of the batch host: the attempt was stopped
# (its time limit, its deadline, a preemption) before its agents could decide.
STOPPED_BY_SCHEDULER = {"TIMEOUT": Cause.TIMEOUT, "DEADLINE": Cause.TIMEOUT, "PREEMPTED": Cause.PREEMPTION}
OUT_OF_MEMORY = "OUT_OF_MEMORY"


@dataclass(frozen=True)
class Seen:
    """What the rescue found of the job's latest attempt. ``beats``: each host's last agent heartbeat
    (mtime) in the job's latest allocation; ``reported``: the hosts whose agents reported the
    attempt; ``scheduler_word``: how the scheduler says the job ended; ``user_stop``: a user's stop
    was pending (``continue_requested``: one that asked for a continuation); ``outcome``: the
    trainer's, if it wrote one; ``published``: the decision an agent published on the attempt, if
    one did."""

    beats: Mapping[str, float]
    reported: Iterable[str] = ()
    scheduler_word: str = ""
    user_stop: bool = False
    continue_requested: bool = False
    outcome: AttemptOutcome | None = None
    published: DecisionRecord | None = None


def find(events: Sequence[Event], job_id: str, *, budgets: Budgets, seen: Seen) -> Finding:
    """The rescue's decision (pure), from the ledger and what it has ``seen`` of the latest attempt."""
    attempts = job_attempts(events, job_id)
    if not attempts:
        return Finding(f"job {job_id} ended before any of its agents started; nothing to decide")
    attempt = attempts[-1]
    history = History.from_events(events)
    if unended_attempt(events, current="") != attempt:
        return Finding(f"attempt {attempt} of job {job_id} was decided; nothing to do", attempt)
    if history.ended is not None:
        return Finding(f"the run has already ended ({history.ended}); nothing to do", attempt)
    if seen.published is not None and not seen.published.get("in_place"):
        # Its decider died carrying it out: the decision stands, the rescue finishes what it began.
        decision = as_decision(seen.published)
        return Finding("", attempt, decision, decision.exclude if decision.action is Action.EXCLUDE else ())
    facts = rescue_facts(events, attempt, job_id, seen)
    return Finding("", attempt, decide(facts, history, budgets, can_exclude_nodes=True), facts.dead_nodes)


def rescue_facts(events: Sequence[Event], attempt: str, job_id: str, seen: Seen) -> Facts:
    """What the rescue knows of an attempt nobody decided, as the facts an agent would gather."""
    started = min((float(e.ts or 0) for e in events if e.attempt == attempt), default=0.0)
    scheduler_word = seen.scheduler_word
    word = scheduler_word.split()[0].upper() if scheduler_word.strip() else ""
    cancelled = word.startswith("CANCEL") or any(
        float(e.ts or 0) >= started for e in of_kind(events, Cancelled)
    )
    ended = f" ({scheduler_word})" if scheduler_word else ""

    def facts(**fields: Any) -> Facts:
        return Facts(
            outcome=seen.outcome,
            cancelled=cancelled,
            user_stop=seen.user_stop,
            continue_requested=seen.continue_requested,
            **fields,
        )

    stopped = STOPPED_BY_SCHEDULER.get(word)
    if stopped is not None:
        return facts(interrupted=stopped, ended_by=f"the scheduler ended job {job_id}{ended}")
    if word == OUT_OF_MEMORY:
        return facts(
            ended_by=f"the scheduler ended job {job_id} {OUT_OF_MEMORY}: a process of the job used more "
            "memory than the job asked for (scheduler.mem_gb)"
        )
    hosts = hosts_of(events, attempt)
    gone = gone_hosts(hosts, seen.beats, seen.reported)
    errors = {e.host: e for e in of_kind(events, AgentError) if e.attempt == attempt and e.host}
    left = errors.get(hosts[0]) if hosts else None
    if left is not None:
        # The batch host's agent left on an error of its own (a filesystem error that outlasted its
        # retries): its node did not die and is not excluded; only hosts silent before it are.
        why = f"the agent on {hosts[0]} (the batch host) left: {left.error}; the scheduler ended job {job_id}{ended}"
        failure = left.error or "an agent error" if left.errno else None
        return facts(read_error=failure, dead_nodes=gone[1:], ended_by=why)
    why = f"the batch host: its job processes died and the scheduler ended job {job_id}{ended} undecided"
    return facts(dead_nodes=gone, node_problems={gone[0]: why} if gone else {})


def last_beats(paths: RunPaths, allocation: str) -> dict[str, float]:
    """Each host's last agent heartbeat in ``allocation`` (``jobs.allocation``'s files)."""
    folder = paths.root / "agents" / allocation.replace("/", "_")
    beats: dict[str, float] = {}
    with contextlib.suppress(FileNotFoundError):
        for entry in folder.iterdir():
            with contextlib.suppress(OSError):
                beats[entry.name] = entry.stat().st_mtime
    return beats


def allocation_of(attempt: str) -> str:
    """``<job>.<restart>`` of an attempt key ``<job>.<restart>[.<n>]``."""
    parts = attempt.split(".")
    return ".".join(parts[:2]) if len(parts) >= 2 else attempt


class Rescue:
    """Carries the finding out: takes the run over from the dead job and continues it."""

    def __init__(self, paths: RunPaths, job_id: str):
        self.paths = paths
        self.job_id = job_id
        self.plan = read_plan(paths)
        self.scheduler: Any = get_scheduler(self.plan.scheduler)
        self.own = next((os.environ[v] for v in SELF_VARS if os.environ.get(v)), "")
        self.lock = RunLock(paths)
        self.word = ""  # how the scheduler says the watched job ended (FAILED, NODE_FAIL, ...)
        self.step: int | None = None  # the step the undecided attempt reached (its decision's `step`)

    def run(self) -> int:
        events = read_events(self.paths).events
        word = self.word = self._scheduler_word()
        attempts = job_attempts(events, self.job_id)
        undecided = bool(attempts) and self._undecided(events, attempts[-1])
        user = take_user_stop(self.paths, attempts[-1]) if undecided else None
        seen = Seen(
            beats=last_beats(self.paths, allocation_of(attempts[-1])) if attempts else {},
            reported=reported_hosts(self.paths, attempts[-1]) if attempts else (),
            scheduler_word=word,
            user_stop=user is not None,
            continue_requested=user is not None and user.continue_,
            outcome=self._outcome(attempts[-1]) if undecided else None,
            published=self._published(attempts[-1]) if undecided else None,
        )
        if undecided:
            self.step = reached_step(self.paths, attempts[-1], seen.outcome)
        finding = find(events, self.job_id, budgets=Budgets.from_plan(self.plan), seen=seen)
        ledger = Ledger(self.paths, role="rescue", attempt=finding.attempt)
        if finding.decision is None:
            ledger.append(RESCUE, job_id=self.job_id, action="nothing", reason=finding.reason, job_ended=word)
            say(finding.reason)
            return 0
        held = self._take_over()
        if isinstance(held, str):
            ledger.append(RESCUE, job_id=self.job_id, action="nothing", reason=held)
            say(held)
            return 0
        return self._carry_out(self._publish(finding, held), held, ledger)

    def _outcome(self, attempt: str) -> AttemptOutcome | None:
        """The trainer's outcome of ``attempt``, read again while the filesystem says "not now"."""
        try:
            return retry_transient(lambda: attempt_outcome(self.paths, attempt))
        except OSError:
            return None

    def _published(self, attempt: str) -> DecisionRecord | None:
        data = poll_json(self.paths.attempt_dir(attempt) / "decision.json", attempts=5)
        return cast(DecisionRecord, data) if isinstance(data, dict) else None

    def _publish(self, finding: Finding, holder: LockHolder) -> Finding:
        """The rescue's decision, published as an agent's is (exclusively): when an agent's decision
        was published meanwhile, that one stands and is the one carried out."""
        decision, attempt = finding.decision, finding.attempt
        assert decision is not None and attempt is not None
        record = decision_record(
            decision,
            attempt=attempt,
            by="rescue",
            epoch=holder.epoch,
            roster=Roster(()),
            next_attempt="",
            step=self.step,
        )
        folder = self.paths.attempt_dir(attempt)
        if create_exclusive(folder / "decision.json", json.dumps(record, indent=1) + "\n"):
            return finding
        standing = self._published(attempt)
        if standing is None or standing.get("in_place") or standing.get("nonce") == record["nonce"]:
            return finding
        theirs = as_decision(standing)
        return Finding("", attempt, theirs, theirs.exclude if theirs.action is Action.EXCLUDE else ())

    def _undecided(self, events: Sequence[Event], attempt: str) -> bool:
        return unended_attempt(events, current="") == attempt

    def _scheduler_word(self) -> str:
        try:
            return self.scheduler.status(self.paths, self.job_id).raw
        except (HpclaunchError, ValueError):
            return ""

    def _take_over(self) -> LockHolder | str:
        """The run's lock, taken from the dead job; a string when another live writer holds the run
        (someone resubmitted it meanwhile): then the rescue leaves it alone."""
        holder = self.lock.read()
        if holder is not None and holder.job_id not in ("", self.job_id, self.own):
            live = liveness(holder, is_active=self._active)
            if live.alive:
                return f"the run is held by {holder.describe()} ({live.why}); the rescue leaves it alone"
        return self.lock.adopt(job_id=self.own or f"rescue-{self.job_id}", role="agent")

    def _active(self, holder: LockHolder) -> bool | None:
        try:
            return get_scheduler(holder.scheduler).status(self.paths, holder.job_id).active
        except (HpclaunchError, ValueError):
            return None

    def _carry_out(self, finding: Finding, holder: LockHolder, ledger: Ledger) -> int:
        decision = finding.decision
        assert decision is not None
        if decision.action not in (Action.EXCLUDE, Action.CONTINUE):  # an end: cancel, stop, budget spent
            record(ledger, decision, job_id=self.job_id, step=self.step)
            self.lock.release(holder)
            return 0 if decision.action in (Action.END, Action.FINISH) else 1
        note = ""
        can_exclude = self.plan.scheduler == "slurm" or self.plan.pbs_dialect == "pro"
        avoid = list(decision.exclude) if decision.action is Action.EXCLUDE else []
        if avoid and not can_exclude:
            note = f"{self.plan.scheduler} ({self.plan.pbs_dialect}) cannot keep a continuation off a node: it may run there again"
        if avoid:
            ledger.append(NODE_EXCLUDED, nodes=list(finding.gone), reason=decision.reason, by="rescue")
        try:
            plan, new_job = self.scheduler.continuation_held(
                self.plan, self.paths, avoid if can_exclude else []
            )
            leave_rescue(self.scheduler, plan, self.paths, new_job, role="rescue")
        except HpclaunchError as e:
            failed = Decision(
                Action.FAIL, decision.cause, f"{decision.reason}; continuing failed: {e.one_line()}"
            )
            record(ledger, failed, job_id=self.job_id, step=self.step)
            self.lock.release(holder)
            return 1
        if plan.spare_nodes < self.plan.spare_nodes:
            left = f"{plan.spare_nodes} hot spare(s) instead of {self.plan.spare_nodes}: too few nodes are left for more"
            note = f"{note}; {left}" if note else left
        record(
            ledger,
            decision,
            job_id=new_job,
            step=self.step,
            note=note,
            for_job=self.job_id,
            job_ended=self.word,
            rescue_job=self.own,
        )
        if not self.lock.hand_over(holder, new_job):
            # Another writer took the run meanwhile (a resubmission): it is theirs now.
            with contextlib.suppress(HpclaunchError, OSError):
                self.scheduler.cancel(self.paths, new_job)
            why = f"the run was taken by another writer meanwhile; its continuation (job {new_job}) withdrawn"
            ledger.append(RESCUE, job_id=self.job_id, action="withdrawn", reason=why)
            say(why)
            return 1
        error = self._release(new_job)
        if error is not None:
            self.lock.release(RunLock(self.paths).read())
            return self._give_up(ledger, decision, new_job, f"it could not be released ({error})")
        return 0

    def _release(self, job: str) -> str | None:
        """Release the held continuation, tried again a few times (a scheduler's brief outage): the
        last error in one line, or None."""
        error = None
        for pause in (*RELEASE_PAUSES_S, None):
            try:
                self.scheduler.release(self.paths, job)
                return None
            except HpclaunchError as e:
                error = e.one_line()
                say(f"releasing job {job} failed: {error}")
            if pause is not None:
                time.sleep(pause)
        return error

    def _give_up(self, ledger: Ledger, decision: Decision, job: str, why: str) -> int:
        """The continuation cannot start: it is withdrawn and the run ends here, resumable, saying
        why (a held job that nothing would ever release strands the run)."""
        with contextlib.suppress(HpclaunchError, OSError):
            self.scheduler.cancel(self.paths, job)
        reason = f"{decision.reason}; the continuation (job {job}) was withdrawn: {why}; {RESUMABLE}"
        record(ledger, Decision(Action.FAIL, decision.cause, reason), job_id=self.job_id, step=self.step)
        return 1


def record(
    ledger: Ledger, decision: Decision, *, job_id: str, step: int | None = None, note: str = "", **extra: Any
) -> None:
    """The decision in the ledger (by: rescue), as an agent records its own (``step``: the step the
    attempt reached); and on stdout."""
    fields = decision.ledger_fields()
    if step is not None:
        fields["step"] = step
    if decision.action in (Action.CONTINUE, Action.EXCLUDE):
        fields.update(by="rescue", in_place=False, counts_as=decision.counts_as)
    if note:
        fields["note"] = note
    ledger.append(decision.event, job_id=job_id, **fields, **extra)
    say(
        f"{decision.action.value}: {decision.reason}"
        + (f" (job {job_id})" if decision.action is Action.EXCLUDE else "")
    )


def say(text: str) -> None:
    print(f"hpclaunch rescue: {text}", flush=True)


def after_run(paths: RunPaths) -> None:
    """A run that has ended for good withdraws the rescue jobs still waiting behind its jobs (the
    deciding agent, after its decision); never raises."""
    try:
        scheduler = get_scheduler(read_plan(paths).scheduler)
        for job in withdraw_rescues(paths, scheduler, role="agent"):
            print(f"hpclaunch: withdrew rescue job {job}: the run has ended", file=sys.stderr, flush=True)
    except (HpclaunchError, OSError, ValueError) as e:
        print(f"hpclaunch: could not withdraw the rescue jobs: {e}", file=sys.stderr, flush=True)


def rescue_main(run_dir: str, job_id: str) -> int:
    paths = RunPaths(Path(run_dir))
    try:
        return Rescue(paths, job_id).run()
    except HpclaunchError as e:
        say(f"error: {e.one_line()}")
        with contextlib.suppress(OSError):
            Ledger(paths, role="rescue").append(RESCUE, job_id=job_id, action="error", reason=e.one_line())
        return 1


def main() -> None:
    if len(sys.argv) != 3:
        print("usage: python -m hpclaunch.jobs.rescue RUN_DIR JOB_ID", file=sys.stderr)
        sys.exit(2)
    sys.exit(rescue_main(sys.argv[1], sys.argv[2]))


if __name__ == "__main__":
    main()
