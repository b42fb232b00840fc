"""Issue 36, finding 1: a decider's authority is fenced, so that a deposed decider can do no harm.

The review's reproduction: node 0's agent stalls past ``DEAD_AFTER_S`` (a GC pause, a hung NFS
client), the next agent takes the decider's role over and, before, overwrote the run lock
unconditionally; when the old decider then published first, its lock hand-over failed silently and
the continuation was refused at admission: nothing continued the run. Here the stalled decider is
a real process stopped with SIGSTOP at each point of its way (``fencing_child``) and resumed once
the other decider has acted; the scheduler, which this unit test cannot run, is a fake that writes
down every call (the SLURM test with a real one: tests/cluster/test_slurm_decider_fencing.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from tests.runlib import wait_for
from tests.unit.fencing_child import EXCLUDE, ROSTER, FakeScheduler, decider

from hpclaunch.jobs.node_checks import StartBarrier
from hpclaunch.rundir import LockHolder, RunLock, RunPaths, read_events
from hpclaunch.rundir import lock as lock_mod

REPO = Path(__file__).resolve().parents[2]


def _child(run: Path, point: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.unit.fencing_child", str(run), point],
        env=env,
        cwd=REPO,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for(lambda: any(run.glob("paused-*")), timeout=120, poll=0.05, what=f"the decider stopped {point}")
    return proc


def _calls(run: Path) -> list[dict[str, Any]]:
    path = run / "calls.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.spawns
@pytest.mark.parametrize("point", ["before-publish", "before-carry-out", "after-submit"])
def test_a_deposed_decider_resumed_at_any_point_leaves_one_decision_and_the_run_continued(
    tmp_path: Path, point: str
) -> None:
    run = tmp_path
    old = _child(run, point)
    # The next agent takes the role over while n1 is stopped (its beats stopped: DEAD_AFTER_S),
    # decides the same attempt and carries its decision out.
    new = decider(run, 1, FakeScheduler(run))
    assert new.role.take_over() and new.role.holder is not None and new.role.holder.epoch == 2
    mine = new.publish(EXCLUDE, ROSTER)
    new.role.close()
    os.kill(old.pid, signal.SIGCONT)
    _, err = old.communicate(timeout=120)
    assert old.returncode == 0, err[-3000:]
    child = json.loads((run / "child.json").read_text())

    published = json.loads((run / "attempts" / "7.0" / "decision.json").read_text())
    decided = [e for e in read_events(RunPaths(run)).events if e.event == "requeued"]
    assert len(decided) == 1, [e.record for e in decided]  # one decision, recorded once
    continuation = decided[0].record["job_id"]
    holder = RunLock(RunPaths(run)).read()
    # The run goes on: the lock is the recorded continuation's, which its admission will adopt.
    assert holder is not None and (holder.job_id, holder.role) == (continuation, "job")
    kept = [c["job"] for c in _calls(run) if c["call"] == "exclude_nodes"]
    withdrawn = [c["job"] for c in _calls(run) if c["call"] == "cancel"]
    assert [j for j in kept if j not in withdrawn] == [continuation]
    assert not child["leads"] and "deposed" in err
    if point == "before-publish":
        # n1's decision came too late: n2's stands and every agent follows it, n1 included.
        assert published["by"] == "n2" and child["record"]["nonce"] == published["nonce"] == mine["nonce"]
    else:
        # n1's decision stands; n2, which deposed it, carried it out.
        assert published["by"] == "n1" and mine["nonce"] == published["nonce"]
        assert continuation == f"cont-{os.getpid()}"
    if point == "after-submit":
        assert withdrawn == [f"cont-{old.pid}"]  # the deposed decider's late job withdrawn


CRITICAL = """
import os, signal, sys, time
from pathlib import Path
from hpclaunch.rundir import RunLock, RunPaths
from hpclaunch.rundir.lock import LockHolder
lock = RunLock(RunPaths(Path(sys.argv[1])))
holder = lock.read()
real_set = lock.set
def set_after_a_stall(h):
    Path(sys.argv[1], "in-critical").write_text(str(os.getpid()))
    os.kill(os.getpid(), signal.SIGSTOP)  # stalled inside its critical section
    real_set(h)
lock.set = set_after_a_stall
print(lock.heartbeat(holder), flush=True)
"""


@pytest.mark.spawns
def test_a_holder_stalled_inside_the_mutex_cannot_undo_a_hand_over_made_meanwhile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``lock.py:61,285-286``: a waiter breaks the mutex after MUTEX_STALE_S and hands the lock on;
    the stalled holder's heartbeat then writes its old view. Before, that write was the lock: the
    hand-over was undone. Now the epochs say who holds it."""
    paths = RunPaths(tmp_path)
    held = RunLock(paths).adopt(job_id="100", role="agent")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    beat = subprocess.Popen([sys.executable, "-c", CRITICAL, str(tmp_path)], env=env, text=True)
    wait_for(lambda: (tmp_path / "in-critical").exists(), timeout=120, poll=0.05, what="the stall")
    monkeypatch.setattr(lock_mod, "MUTEX_STALE_S", 0.3)
    # (the stalled writer is this host's, and alive: broken only after MUTEX_STALE_S)
    mine = LockHolder(
        held.job_id, held.scheduler, held.role, held.host, held.pid, held.acquired, 0, held.epoch
    )
    assert RunLock(paths).hand_over(mine, "101")
    os.kill(beat.pid, signal.SIGCONT)
    assert beat.wait(timeout=120) == 0
    now = RunLock(paths).read()
    assert now is not None and (now.job_id, now.role) == ("101", "job")
    assert not RunLock(paths).hand_over(held, "102")  # the old holder hands nothing on either


def test_two_deciders_cannot_announce_two_rosters(tmp_path: Path) -> None:
    """``go.json`` was replaced by whoever wrote last: two deciders could start two rosters."""
    barrier = StartBarrier(RunPaths(tmp_path).ensure(), "7.0")
    first = barrier.announce(go=True, roster={"training": ["n1", "n2"], "spares": ["n3"]}, epoch=1)
    second = barrier.announce(go=True, roster={"training": ["n3", "n2"], "spares": []}, epoch=2)
    assert first.ours and not second.ours
    assert second.roster == first.roster == {"training": ["n1", "n2"], "spares": ["n3"]}
    assert barrier.wait_go(timeout_s=1).roster == first.roster


def test_a_deposed_holder_hands_nothing_on_and_releases_nothing(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path)
    old = RunLock(paths).adopt(job_id="7", role="agent")
    new = RunLock(paths).take_role(job_id="7")
    assert new is not None and new.epoch == old.epoch + 1
    assert not RunLock(paths).holds(old) and RunLock(paths).holds(new)
    assert not RunLock(paths).hand_over(old, "8")
    RunLock(paths).release(old)
    assert RunLock(paths).read() == new
    assert RunLock(paths).take_role(job_id="7") is not None  # its own job's agents may take it on
    assert RunLock(paths).hand_over(RunLock(paths).read(), "8")  # type: ignore[arg-type]
    assert RunLock(paths).take_role(job_id="7") is None  # not from the job that continues the run


class HeldContinuationScheduler(FakeScheduler):
    """PBS's part for a sweep point: its continuation is submitted held (no dependency on a sub-job)
    and released by the decider; ``release`` notes who held the run's lock when it was called."""

    def __init__(self, run: Path) -> None:
        super().__init__(run)
        self.run = run

    def continue_job(self, plan: Any, paths: Any, ctx: Any) -> Any:
        from hpclaunch.schedulers.protocol import Continuation

        self._call(call="continue_job", job="8")
        return Continuation("8", held=True)

    def release(self, paths: Any, job_id: str) -> None:
        holder = RunLock(RunPaths(self.run)).read()
        self._call(call="release", job=job_id, lock_job=holder.job_id if holder else None)


def test_a_held_continuation_is_released_after_the_record_and_the_hand_over_not_withdrawn(
    tmp_path: Path,
) -> None:
    """Found on the real OpenPBS: a sweep point's continuation (submitted held) was handed the run's
    lock inside the scheduler call, before the decider recorded its decision; the hand-over claimed
    the lock's next epoch, so the decider found itself deposed, recorded nothing and withdrew its
    own continuation: the run stranded and the rescue failed it."""
    from hpclaunch.jobs.decision_rules import Action, Decision
    from hpclaunch.rundir.cause import Budget, Cause

    scheduler = HeldContinuationScheduler(tmp_path)
    d = decider(tmp_path, 0, scheduler)
    d.role.hold(RunLock(d.node.paths).adopt(job_id="7", role="agent"))
    d.role.beat_every_s = 3600.0
    timeout = Decision(Action.CONTINUE, Cause.TIMEOUT, "the time limit", counts_as=Budget.REQUEUE)
    assert d.carry_out(timeout) == 0
    d.role.close()
    calls = [(c["call"], c["job"], c.get("lock_job")) for c in _calls(tmp_path)]
    assert calls == [("continue_job", "8", None), ("release", "8", "8")]  # released once it holds the run
    decided = [e for e in read_events(RunPaths(tmp_path)).events if e.event == "requeued"]
    assert len(decided) == 1 and decided[0].record.get("job_id") == "8"


def test_a_pbs_sweep_points_continuation_is_submitted_held_and_the_lock_left_to_the_decider(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hpclaunch.schedulers import pbs
    from hpclaunch.schedulers.protocol import NodeContext

    paths = RunPaths(tmp_path)
    paths.scheduler_dir.mkdir(parents=True, exist_ok=True)
    mine = RunLock(paths).adopt(job_id="5[1].pbshead", role="agent")
    argvs: list[list[str]] = []
    monkeypatch.setattr(pbs, "qsub", lambda argv, cwd: argvs.append(argv) or "9.pbshead")
    monkeypatch.setattr(pbs, "_run", lambda argv, what: pytest.fail(f"{what} before the hand-over"))
    ctx = NodeContext("pbs", "5[1].pbshead", 0, 1, "pbshead", ("pbshead",), array_task=1)
    assert pbs.submit_after(tmp_path / "job.pbs", paths, ctx) == "9.pbshead"
    assert argvs == [["-h", str(tmp_path / "job.pbs")]]
    assert RunLock(paths).holds(mine)  # the decider's epoch still stands: it records, then hands over
