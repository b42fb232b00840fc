"""Issue 49, M3 (and L6): an in-place decision whose decider is deposed right after publishing it was
followed by every agent and recorded by none (the record was skipped inside ``suppress(Deposed)``):
budgets undercounted, the attempt left unended, and the next allocation's admission decided it again
as a preemption, spending a requeue (failing the run at ``max_requeues``). Now the decider that
deposed it records it, once.

Two real deciders of one allocation in this process (the run lock, its epochs, the ledger and the
published decision are the real ones; the scheduler, which no in-place decision calls, a fake)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from tests.unit.fencing_child import FakeScheduler, decider

from hpclaunch.jobs.allocation import Roster
from hpclaunch.jobs.decision_rules import Action, Decision, unended_attempt
from hpclaunch.rundir import RunLock, RunPaths, read_events
from hpclaunch.rundir.cause import Budget, Cause

pytestmark = pytest.mark.fast

ROSTER = Roster(("n1", "n2"), ("n3",))
IN_PLACE = Decision(
    Action.CONTINUE,
    Cause.CRASH,
    "rank 1 crashed; restarted in place",
    in_place=True,
    counts_as=Budget.CRASH,
)


def in_place_records(run: Path) -> list[dict[str, Any]]:
    return [
        e.record for e in read_events(RunPaths(run)).events if e.event == "requeued" and e.attempt == "7.0"
    ]


def deposed_after_publishing(
    run: Path, decision: Decision = IN_PLACE, *, reached: int | None = None
) -> tuple[Any, Any, dict[str, Any]]:
    """n1 decides and publishes; n2 takes the role over right after the publication (n1 stalled)."""
    old, new = decider(run, 0, FakeScheduler(run)), decider(run, 1, FakeScheduler(run))
    old.reached_step = reached  # (what n1's look at the attempt found)
    for d in (old, new):
        d.role.beat_every_s = 3600.0
    old.role.hold(RunLock(old.node.paths).adopt(job_id="7", role="agent"))
    real = old.node.alloc.publish

    def publish_then_stall(attempt: str, record: Any) -> bool:
        done = real(attempt, record)
        assert new.role.take_over()  # (while n1 stalls between its publication and its record)
        return done

    old.node.alloc.publish = publish_then_stall  # type: ignore[method-assign]
    published = old.publish(decision, ROSTER)
    return old, new, dict(published)


def test_the_decider_that_deposed_the_publisher_records_its_in_place_decision_once(tmp_path: Path) -> None:
    old, new, published = deposed_after_publishing(tmp_path)
    assert published["in_place"] and in_place_records(tmp_path) == []  # (n1 recorded nothing)
    # n2 had taken the role: it decides this attempt too, finds n1's decision standing, follows it
    followed = new.publish(IN_PLACE, ROSTER)
    assert followed["nonce"] == published["nonce"]
    (record,) = in_place_records(tmp_path)
    assert record["in_place"] and record["note"] == "decided by n1 (deposed)"
    # once: n1, resumed and following, and n2 looking again record nothing more
    old.record_followed(published)
    new.record_followed(published)
    assert len(in_place_records(tmp_path)) == 1
    events = read_events(RunPaths(tmp_path)).events
    assert unended_attempt(events, current="7.0.1") is None  # the next admission decides nothing again
    old.role.close()
    new.role.close()


def test_the_record_made_for_a_deposed_decider_says_what_its_own_would_have(tmp_path: Path) -> None:
    """A node replaced by a spare, the suspect and the step reached travel in the published decision:
    the record n2 makes for n1 carries them (CI saw `status` show no replacement: the record n2
    made had only the action, the cause and the reason)."""
    replacing = replace(IN_PLACE, cause=Cause.NODE_FAILURE, replace=(("n1", "n3"),), suspect="n1")
    old, new, published = deposed_after_publishing(tmp_path, replacing, reached=29)
    new.role.leads = True
    new.record_followed(published)
    (record,) = in_place_records(tmp_path)
    assert record["note"] == "decided by n1 (deposed)"
    assert (record["replaced"], record["suspect"], record["step"]) == ({"n1": "n3"}, "n1", 29)
    old.role.close()
    new.role.close()


def test_a_decider_that_takes_the_role_later_records_the_last_decision_it_followed(tmp_path: Path) -> None:
    old, new, published = deposed_after_publishing(tmp_path)
    new.role.leads = False  # (it heard the decision as a follower, before it looked at the role)
    new.record_followed(published)
    assert in_place_records(tmp_path) == []
    new.role.holder, new.role.leads = None, False
    assert new.role.take_over()  # the next attempt's poll finds the role its own: it records then
    assert len(in_place_records(tmp_path)) == 1
    old.role.close()
    new.role.close()


def test_a_decider_whose_lock_heartbeat_found_it_deposed_is_not_fenced(tmp_path: Path) -> None:
    """L6: ``Heartbeat.lost`` was set and never read: the heartbeat thread knew the lock was gone
    while the decider went on as if it held it (until its next epoch check)."""
    d = decider(tmp_path, 0, FakeScheduler(tmp_path))
    d.role.beat_every_s = 3600.0
    d.role.hold(RunLock(d.node.paths).adopt(job_id="7", role="agent"))
    assert d.role.fenced()
    assert d.role._beat is not None
    d.role._beat.lost = True  # (what its thread sets when lock.heartbeat says the lock is not its own)
    assert not d.role.fenced()
    d.role.close()


class RequeueOnce(FakeScheduler):
    """SLURM's requeue of this very job: a second ``scontrol requeue`` of the requeued job fails."""

    def __init__(self, run: Path) -> None:
        super().__init__(run)
        self.requeued = 0
        self.then: Any = None  # what happens right after the call returned (a stall)

    def continue_job(self, plan: Any, paths: Any, ctx: Any) -> Any:
        from hpclaunch.errors import SchedulerError
        from hpclaunch.schedulers.protocol import Continuation

        self.requeued += 1
        if self.requeued > 1:
            raise SchedulerError(
                "scontrol requeue failed: Job is pending execution", where="scontrol requeue"
            )
        if self.then is not None:
            self.then()
        return Continuation("7")


def test_a_decider_deposed_between_its_requeue_and_its_record_is_not_requeued_twice(tmp_path: Path) -> None:
    """L2: the decider that deposed it found no record, requeued again, and recorded that second
    requeue's failure: FAILED. It records the requeue that was made instead, once."""
    scheduler = RequeueOnce(tmp_path)
    old, new = decider(tmp_path, 0, scheduler), decider(tmp_path, 1, scheduler)
    for d in (old, new):
        d.role.beat_every_s = 3600.0
    old.role.hold(RunLock(old.node.paths).adopt(job_id="7", role="agent"))
    timeout = Decision(Action.CONTINUE, Cause.TIMEOUT, "the time limit", counts_as=Budget.REQUEUE)
    scheduler.then = new.role.take_over  # (n1 stalls right after its requeue, before its record)
    published = old.publish(timeout, Roster(("n1", "n2")))
    assert published["exit_code"] == 0 and not old.role.leads
    new.publish(timeout, Roster(("n1", "n2")))  # n2 finds n1's decision standing and completes it
    assert scheduler.requeued == 1
    decided = [e.record for e in read_events(RunPaths(tmp_path)).events if e.event in ("requeued", "failed")]
    assert [(e["event"], e.get("job_id")) for e in decided] == [("requeued", "7")]
    holder = RunLock(RunPaths(tmp_path)).read()
    assert holder is not None and (holder.job_id, holder.role) == ("7", "job")  # handed to the requeued job
    old.role.close()
    new.role.close()
