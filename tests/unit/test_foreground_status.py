"""What the scheduler "says" of a foreground ``hpclaunch train`` (its own process is the job: the run
lock answers), and a run whose attempt has ended while its job or process is still exiting."""

from __future__ import annotations

import os
import socket
import time
from dataclasses import asdict
from pathlib import Path

import pytest

from hpclaunch.orchestrator.status import attempts_from_events, run_state
from hpclaunch.rundir import RunLock, RunPaths
from hpclaunch.rundir.events import as_events
from hpclaunch.rundir.lock import LockHolder
from hpclaunch.schedulers import foreground
from hpclaunch.schedulers.local import LocalScheduler
from hpclaunch.schedulers.protocol import JobState

pytestmark = pytest.mark.fast


def _hold(paths: RunPaths, job_id: str, pid: int) -> None:
    now = time.time()
    host = socket.gethostname().split(".")[0]
    RunLock(paths).set(LockHolder(job_id, "local", "train", host, pid, now, now))


def test_a_foreground_job_is_running_while_its_process_holds_the_lock(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path).ensure()
    job = foreground.job_id()
    assert job == f"fg{os.getpid()}" and foreground.is_foreground(job)
    assert not foreground.is_foreground("local123") and not foreground.is_foreground("fgx")
    _hold(paths, job, os.getpid())
    said = LocalScheduler().status(paths, job)  # the local scheduler hands it on: no controller state
    assert said.state is JobState.RUNNING and said.active, asdict(said)


def test_a_foreground_job_has_ended_once_the_lock_is_released_or_another_job_holds_it(
    tmp_path: Path,
) -> None:
    paths = RunPaths(tmp_path).ensure()
    assert LocalScheduler().status(paths, "fg12").state is JobState.COMPLETED
    _hold(paths, "local99", os.getpid())
    assert LocalScheduler().status(paths, "fg12").state is JobState.COMPLETED


def test_a_foreground_job_whose_process_died_holding_the_lock_is_not_running(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path).ensure()
    _hold(paths, "fg0", 0)  # pid 0 is no process: gone, on this very host
    said = foreground.status(paths, "fg0")
    assert said.state is JobState.FAILED and "died without deciding" in said.reason


LEDGER = [
    {"event": "submitted", "ts": 1.0, "job_id": "local7"},
    {"event": "started", "ts": 2.0, "attempt": "local7.0", "node": 0},
    {"event": "resumed", "ts": 3.0, "attempt": "local7.0", "step": 0},
    {"event": "stopped", "ts": 9.0, "attempt": "local7.0", "step": 40, "cause": "user"},
]


def test_an_ended_attempt_whose_job_is_still_exiting_is_stopping_not_stopped() -> None:
    events = as_events(LEDGER)
    attempts = attempts_from_events(events)
    assert run_state(attempts, events, "completed") == "stopped"
    # The controller (or the foreground train) has not exited yet: not resumable, and said so.
    assert run_state(attempts, events, "running") == "stopping"
    assert run_state(attempts, events, "completed", exiting=True) == "stopping"
    finished = as_events([*LEDGER[:3], {"event": "finished", "ts": 9.0, "attempt": "local7.0", "step": 50}])
    assert run_state(attempts_from_events(finished), finished, None, exiting=True) == "finishing"


@pytest.mark.spawns
def test_cancel_never_signals_a_process_that_took_the_dead_trains_pid(tmp_path: Path) -> None:
    """Issue 49, L5: a foreground train died holding the lock, and its pid now names another process
    (pids are reused): ``cancel`` sent that process SIGTERM. The lock names the holder's start too."""
    import subprocess
    import sys

    from hpclaunch.errors import SchedulerError
    from hpclaunch.rundir.lock import process_start

    paths = RunPaths(tmp_path).ensure()
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        now = time.time()
        host = socket.gethostname().split(".")[0]
        started = process_start(other.pid)
        job = f"fg{other.pid}"
        # the train that held the lock under this pid started at another time: this is not it
        RunLock(paths).set(
            LockHolder(job, "local", "train", host, other.pid, now, now, pid_start=started - 7)
        )
        assert foreground.status(paths, job).state is JobState.FAILED
        with pytest.raises(SchedulerError, match="not running"):
            foreground.cancel(paths, job)
        assert other.poll() is None  # not signalled
        # the very process that holds it is signalled (through a pidfd)
        RunLock(paths).set(LockHolder(job, "local", "train", host, other.pid, now, now, pid_start=started))
        assert foreground.status(paths, job).state is JobState.RUNNING
        foreground.cancel(paths, job)
        assert other.wait(timeout=60) == -15
    finally:
        if other.poll() is None:
            other.kill()
            other.wait()
