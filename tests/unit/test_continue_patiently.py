"""Issue 49, M1 and M5: the scheduler calls that continue a run, when the scheduler is busy.

M1: a timed-out ``scontrol requeue``, ``sbatch`` or ``qsub`` was tried once, and the run was recorded
FAILED; the rescue then saw an ended run and did nothing. A preemption storm is exactly when
controllers are slow. Now the call is tried again within the time the allocation has left; when it
never answers, the run is left to the rescue job held on this job (its decision published, not
recorded), or, with none, ends resumable with a hint that works.

M5: a PBS sweep point's continuation is submitted held and released after the lock's hand-over;
when ``qrls`` failed 4 times in ~17 s the held job kept the lock, the agent exited 0, nothing
released it, and the hint printed (``submit --resume``) was refused while the held job owned the
lock. Now the release is tried within the allocation's time, then the held job is withdrawn, the
lock released and the run ended resumable.

The scheduler is a fake here (it refuses as a busy slurmctld or PBS server does; the real SLURM
with an ``scontrol`` that fails once: tests/cluster/test_slurm_in_place.py); the deciders, the lock,
the ledger and the published decision are the real ones, in a real run directory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from tests.unit.fencing_child import FakeScheduler, decider

from hpclaunch.errors import RunLockedError, SchedulerError
from hpclaunch.jobs import carry_out as carry_mod
from hpclaunch.jobs.allocation import Roster
from hpclaunch.jobs.decision_rules import Action, Decision
from hpclaunch.rundir import RESCUE_SUBMITTED, Ledger, RunLock, RunPaths, read_events
from hpclaunch.rundir.cause import Budget, Cause
from hpclaunch.schedulers.protocol import Continuation

pytestmark = pytest.mark.fast

TIMEOUT = Decision(Action.CONTINUE, Cause.TIMEOUT, "the time limit", counts_as=Budget.REQUEUE)


@pytest.fixture(autouse=True)
def _no_waiting(monkeypatch: pytest.MonkeyPatch) -> None:
    """No pause between the tries, and an allocation that ends soon (its time is the test's)."""
    monkeypatch.setattr(carry_mod, "RETRY_PAUSES_S", (0.0,))
    monkeypatch.setattr(carry_mod, "RELEASE_PAUSES_S", (0.0,))
    monkeypatch.setattr(carry_mod, "RETRY_FOR_S", 0.3)


class BusyScheduler(FakeScheduler):
    """A controller that times out ``refusals`` times, then answers (-1: never)."""

    def __init__(self, run: Path, refusals: int, *, held: bool = False, releases_refused: int = 0) -> None:
        super().__init__(run)
        self.refusals, self.held, self.releases_refused = refusals, held, releases_refused

    def continue_job(self, plan: Any, paths: Any, ctx: Any) -> Continuation:
        self._call(call="continue_job")
        if self.refusals != 0:
            self.refusals -= 1
            raise SchedulerError("scontrol requeue did not answer within 60 s", where="scontrol requeue")
        return Continuation("8" if self.held else "7", held=self.held)

    def release(self, paths: Any, job_id: str) -> None:
        self._call(call="release", job=job_id)
        if self.releases_refused != 0:
            self.releases_refused -= 1
            raise SchedulerError("qrls: cannot connect to server", where="qrls")


def run_of(tmp_path: Path, scheduler: BusyScheduler, *, rescue: bool = False) -> Any:
    d = decider(tmp_path, 0, scheduler)
    d.role.hold(RunLock(d.node.paths).adopt(job_id="7", role="agent"))
    d.role.beat_every_s = 3600.0
    if rescue:  # (as ``schedulers.rescue_job.leave_rescue`` records it at submission)
        Ledger(d.node.paths, role="cli").append(RESCUE_SUBMITTED, job_id="7", rescue_job="70")
    return d


def decided(run: Path) -> list[tuple[str, str]]:
    kinds = ("requeued", "failed", "ended")
    return [
        (e.event, e.record.get("reason", "")) for e in read_events(RunPaths(run)).events if e.event in kinds
    ]


def calls(run: Path) -> list[str]:
    return [json.loads(line)["call"] for line in (run / "calls.jsonl").read_text().splitlines()]


def test_a_requeue_the_controller_refuses_once_is_asked_again_and_the_run_continues(tmp_path: Path) -> None:
    d = run_of(tmp_path, BusyScheduler(tmp_path, refusals=1))
    assert d.publish(TIMEOUT, Roster(("n1",)))["exit_code"] == 0
    d.role.close()
    assert calls(tmp_path) == ["continue_job", "continue_job"]
    assert [k for k, _ in decided(tmp_path)] == ["requeued"]  # never FAILED
    holder = RunLock(RunPaths(tmp_path)).read()
    assert holder is not None and (holder.job_id, holder.role) == ("7", "job")


def test_a_request_the_scheduler_refuses_for_good_is_asked_once_and_the_run_fails(tmp_path: Path) -> None:
    """Not a busy controller: sbatch can never place a job on nodes that do not exist (two nodes, one
    excluded); asked again for ten minutes before (CI's test_a_non_head_node_that_fails_its_check)."""

    class Refuses(BusyScheduler):
        def continue_job(self, plan: Any, paths: Any, ctx: Any) -> Continuation:
            self._call(call="continue_job")
            raise SchedulerError(
                "sbatch: error: Batch job submission failed: Requested node configuration is not available",
                where="sbatch",
            )

    d = run_of(tmp_path, Refuses(tmp_path, refusals=-1), rescue=True)
    assert d.publish(TIMEOUT, Roster(("n1",)))["exit_code"] == 1
    d.role.close()
    assert calls(tmp_path) == ["continue_job"]
    ((kind, reason),) = decided(tmp_path)
    assert kind == "failed" and "Requested node configuration is not available" in reason, reason
    assert SchedulerError("scontrol requeue did not answer within 60 s").refused_for_good is False


def test_a_controller_that_never_answers_leaves_the_run_to_its_rescue_job(tmp_path: Path) -> None:
    d = run_of(tmp_path, BusyScheduler(tmp_path, refusals=-1), rescue=True)
    record = d.publish(TIMEOUT, Roster(("n1",)))
    d.role.close()
    assert record["exit_code"] == 1  # the job ends failed: the rescue held on it starts
    assert len(calls(tmp_path)) > 1 and decided(tmp_path) == []  # undecided: the rescue decides
    published = json.loads((tmp_path / "attempts" / "7.0" / "decision.json").read_text())
    assert published["action"] == "continue" and not published["in_place"]
    (left,) = [e for e in read_events(RunPaths(tmp_path)).events if e.event == "agent_error"]
    assert "the rescue job 70 continues the run" in left.record["error"]
    # the lock stays the job's: the rescue takes it from the dead job (its next epoch)
    holder = RunLock(RunPaths(tmp_path)).read()
    assert holder is not None and holder.job_id == "7"


def test_without_a_rescue_the_run_ends_resumable_and_resume_is_not_refused(tmp_path: Path) -> None:
    d = run_of(tmp_path, BusyScheduler(tmp_path, refusals=-1))
    assert d.publish(TIMEOUT, Roster(("n1",)))["exit_code"] == 1
    d.role.close()
    ((kind, reason),) = decided(tmp_path)
    assert kind == "ended" and "it can be resumed" in reason and f"submit --resume {tmp_path}" in reason
    RunLock(RunPaths(tmp_path)).acquire(job_id="9", scheduler="slurm", role="job", is_active=lambda h: False)


def test_a_held_continuation_released_on_a_later_try_starts(tmp_path: Path) -> None:
    d = run_of(tmp_path, BusyScheduler(tmp_path, refusals=0, held=True, releases_refused=2))
    assert d.carry_out(TIMEOUT) == 0
    d.role.close()
    assert calls(tmp_path) == ["continue_job", "release", "release", "release"]
    assert [k for k, _ in decided(tmp_path)] == ["requeued"]


def test_a_held_continuation_that_cannot_be_released_is_withdrawn_and_the_run_resumable(
    tmp_path: Path,
) -> None:
    d = run_of(tmp_path, BusyScheduler(tmp_path, refusals=0, held=True, releases_refused=-1))
    assert d.carry_out(TIMEOUT) == 1
    d.role.close()
    assert calls(tmp_path)[-1] == "cancel" and "release" in calls(tmp_path)
    kinds = decided(tmp_path)
    assert [k for k, _ in kinds] == ["requeued", "ended"]
    assert "job 8 could not be released" in kinds[-1][1] and "submit --resume" in kinds[-1][1]
    # the hint works: the lock the held job was handed is free again (before: RunLockedError)
    lock = RunLock(RunPaths(tmp_path))
    assert lock.read() is None
    try:
        lock.acquire(job_id="9", scheduler="pbs", role="job", is_active=lambda h: True)
    except RunLockedError as e:  # pragma: no cover - the failure this test guards against
        pytest.fail(f"submit --resume would be refused: {e}")
