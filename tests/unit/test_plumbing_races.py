"""Issue 25: the small races of the plumbing at scale (one test or more per finding): the NFS-safe
exclusive create, the lock heartbeat as a compare-and-swap, the relay before any scheduler query."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from hpclaunch import fsutil
from hpclaunch.jobs import stop_relay
from hpclaunch.jobs.node_run import NodeRun
from hpclaunch.jobs.stop_relay import StopRelay
from hpclaunch.rundir import RunLock, RunPaths
from hpclaunch.rundir import lock as lock_mod
from hpclaunch.rundir.cause import Cause
from hpclaunch.rundir.control import relay_stop
from hpclaunch.rundir.lock import LockHolder
from hpclaunch.schedulers.protocol import NodeContext

pytestmark = pytest.mark.fast

# ---- 4. create_exclusive: EEXIST for our own, retransmitted LINK ------------------------------------


def test_create_exclusive_counts_a_retransmitted_link_that_says_eexist_as_ours(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An NFS client whose LINK reply was lost sends it again; the server answers the retry EEXIST,
    # though the first call made the link. Before: "someone else published", and a decision written
    # that way was read back as another's and never carried out.
    real_link = os.link

    def retransmitted(src: os.PathLike[str], dst: os.PathLike[str]) -> None:
        real_link(src, dst)
        raise FileExistsError(17, "File exists (the retransmitted LINK)")

    monkeypatch.setattr(fsutil.os, "link", retransmitted)
    target = tmp_path / "decision.json"
    assert fsutil.create_exclusive(target, "mine")
    assert target.read_text() == "mine"
    assert [p.name for p in tmp_path.iterdir()] == ["decision.json"]  # the temporary name is gone


def test_create_exclusive_still_loses_to_a_file_that_was_there(tmp_path: Path) -> None:
    target = tmp_path / "decision.json"
    target.write_text("theirs")
    assert not fsutil.create_exclusive(target, "mine")
    assert target.read_text() == "theirs"


# ---- 3. the lock heartbeat: a compare-and-swap ---------------------------------------------------


def _agent(job: str) -> LockHolder:
    now = time.time()
    return LockHolder(job, "slurm", "agent", "node0", 4242, now, now)


@pytest.mark.parametrize("meanwhile", ["hand_over", "release"])
def test_a_heartbeat_never_writes_back_over_a_hand_over_or_release_made_after_its_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, meanwhile: str
) -> None:
    # Forced interleaving: the heartbeat has read "mine"; the attempt's other thread (another
    # process, in production) hands the lock on to job 101 or releases it, and gets a moment to
    # finish; then the heartbeat writes. Before: the lock held job 100 again (and a continuation
    # on another host was refused for up to 90 s); a release was undone.
    paths = RunPaths(tmp_path)
    old = _agent("100")
    RunLock(paths).set(old)
    beating = RunLock(paths)
    real_read = beating.read
    other: list[threading.Thread] = []

    def read_then_interleave() -> LockHolder | None:
        seen = real_read()
        if not other:
            if meanwhile == "hand_over":
                t = threading.Thread(target=lambda: RunLock(paths).hand_over(old, "101"))
            else:
                t = threading.Thread(target=lambda: RunLock(paths).release(old))
            other.append(t)
            t.start()
            t.join(timeout=0.5)  # done by now without a guard; blocked until the write with one
        return seen

    monkeypatch.setattr(beating, "read", read_then_interleave)
    assert beating.heartbeat(old)
    other[0].join(timeout=10)
    assert not other[0].is_alive()
    now = RunLock(paths).read()
    if meanwhile == "hand_over":
        assert now is not None and (now.job_id, now.role) == ("101", "job")
    else:
        assert now is None
    assert not list(tmp_path.glob("lock.json.writing*"))  # the mutex is gone


def test_a_mutex_left_by_a_dead_holder_on_this_host_is_broken_at_once(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path)
    old = _agent("100")
    lock = RunLock(paths)
    lock.set(old)
    dead = json.dumps({"host": lock_mod._this_host(), "pid": 2**22 + 7, "nonce": "x"})
    (tmp_path / "lock.json.writing").write_text(dead)
    started = time.monotonic()
    assert lock.hand_over(old, "101")
    assert time.monotonic() - started < 5
    assert lock.read().job_id == "101"  # type: ignore[union-attr]
    assert not list(tmp_path.glob("*lock.json.writing*"))


def test_a_mutex_whose_token_does_not_change_is_broken_after_the_stale_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A holder on another host that died inside its critical section: judged by observation (the
    # same token for MUTEX_STALE_S on this process's monotonic clock), never by the file's mtime.
    monkeypatch.setattr(lock_mod, "MUTEX_STALE_S", 0.3)
    paths = RunPaths(tmp_path)
    old = _agent("100")
    lock = RunLock(paths)
    lock.set(old)
    (tmp_path / "lock.json.writing").write_text(json.dumps({"host": "elsewhere", "pid": 1, "nonce": "y"}))
    assert lock.heartbeat(old)
    assert not list(tmp_path.glob("*lock.json.writing*"))


# ---- 5. the relay before any scheduler query -------------------------------------------------------


class _SlowScheduler:
    """A controller loaded by a preemption storm: ``scontrol show job`` answers only after a while
    (here: as soon as the ranks have been signalled, or after 5 s)."""

    def __init__(self, cause: Cause, signalled: threading.Event) -> None:
        self.cause = cause
        self.signalled = signalled
        self.ranks_signalled_before_answer: bool | None = None

    def termination_cause(self, paths: RunPaths, ctx: NodeContext, *, now: float) -> Cause:
        self.ranks_signalled_before_answer = self.signalled.wait(timeout=5.0)
        return self.cause

    def kill_grace_s(self, plan: Any) -> float:
        return 30.0


@pytest.mark.parametrize("cause", [Cause.PREEMPTION, Cause.TIMEOUT, Cause.CANCELLED])
def test_a_sigterm_reaches_the_ranks_before_the_scheduler_is_asked_what_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cause: Cause
) -> None:
    # Before: every agent asked the scheduler first (30 s timeout), then relayed: in a storm that
    # ate the KillWait (30 s by default) the ranks needed for their stop save.
    sent: list[tuple[int, int]] = []
    signalled = threading.Event()

    def kill(pid: int, signum: int) -> None:
        sent.append((pid, signum))
        signalled.set()

    monkeypatch.setattr(stop_relay.os, "kill", kill)
    paths = RunPaths(tmp_path)
    ctx = NodeContext("slurm", "7", 0, 2, "n0", ("n0", "n1"), restart_count=0)
    scheduler = _SlowScheduler(cause, signalled)
    plan: Any = None
    relay = StopRelay(NodeRun.start(paths, plan, ctx, scheduler))  # type: ignore[arg-type]
    relay.ranks = lambda: [4242, 4243]
    relay.inbox.received.append((signal.SIGTERM, time.time()))
    relay.handle_signals()
    assert scheduler.ranks_signalled_before_answer is True
    assert sent == [(4242, signal.SIGTERM), (4243, signal.SIGTERM)]  # once each, not again after
    # ... and the cause is settled after: the request the ranks read, and the agent's own facts.
    request = relay_stop(paths, "7.0")
    assert request is not None
    assert request.cause is (Cause.TIMEOUT if cause is Cause.TIMEOUT else Cause.PREEMPTION)
    assert relay.cancelled is (cause is Cause.CANCELLED)
    assert relay.cut_off_at is not None
