"""The run directory's contract: one ledger file per writer merged by readers, torn lines reported,
the run-directory lock (a second writer refused, a stale holder taken over), attempt outcomes."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from hpclaunch.errors import RunLockedError
from hpclaunch.jobs.node_checks import NodeVerdict, Verdicts
from hpclaunch.rundir import (
    AttemptOutcome,
    Ledger,
    RunLock,
    RunPaths,
    holder_alive,
    read_events,
    read_outcome,
    write_outcome,
)
from hpclaunch.rundir.events import CheckpointSaved, Event, Started, as_events, parse_event
from hpclaunch.rundir.lock import STALE_AFTER_S


def _append_many(root: str, role: str, n: int) -> None:
    ledger = Ledger(RunPaths(Path(root)), role=role)
    for i in range(n):
        ledger.append("tick", i=i, writer_role=role)


def test_every_writer_has_its_own_file_and_readers_merge_them(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_append_many, args=(str(tmp_path), f"w{k}", 200)) for k in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    files = sorted(paths.events_dir.glob("*.jsonl"))
    assert len(files) == 3  # one per process: no two processes ever append to one file
    log = read_events(paths)
    assert log.torn == [] and len(log.events) == 600
    stamps = [e.ts for e in log.events]
    assert stamps == sorted(stamps)
    for k in range(3):  # each writer's own order survives the merge
        mine = [e.record["i"] for e in log.events if e.record["writer_role"] == f"w{k}"]
        assert mine == list(range(200))


def test_a_torn_line_is_reported_with_file_and_line_not_dropped(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path)
    ledger = Ledger(paths, role="agent", node=0)
    ledger.append("started", job_id="7")
    with open(ledger.path, "ab") as f:
        f.write(b'{"ts": 1.0, "event": "stopp')  # the writer died mid-line
    log = read_events(paths)
    assert [e.event for e in log.events] == ["started"]
    assert len(log.torn) == 1
    assert log.torn[0].startswith(f"events/{ledger.path.name}:2: torn last line")


def test_an_event_is_recorded_when_the_filesystem_says_not_now_for_a_moment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decision's event reaches the ledger through ESTALE on the folder (the ledger's first
    write makes it) and on the open: each is tried again (the ESTALE scenario of
    bench/control_plane_faults.py lost its decider to the folder's ESTALE)."""
    import errno

    paths = RunPaths(tmp_path / "run")
    ledger = Ledger(paths, role="agent")
    real_mkdir, real_open = Path.mkdir, os.open
    stale = {"mkdir": 1, "open": 1}

    def mkdir(self: Path, *a: object, **kw: object) -> None:
        if stale["mkdir"]:
            stale["mkdir"] -= 1
            raise OSError(errno.ESTALE, "Stale file handle", str(self))
        real_mkdir(self, *a, **kw)  # type: ignore[arg-type]

    def open_(path: object, *a: object, **kw: object) -> int:
        if str(path) == str(ledger.path) and stale["open"]:
            stale["open"] -= 1
            raise OSError(errno.ESTALE, "Stale file handle", str(path))
        return real_open(path, *a, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(Path, "mkdir", mkdir)
    monkeypatch.setattr(os, "open", open_)
    ledger.append("requeued", reason="x")
    monkeypatch.undo()
    assert stale == {"mkdir": 0, "open": 0}
    assert [e.event for e in read_events(paths).events] == ["requeued"]
    assert read_events(paths).torn == []


def test_a_run_made_before_the_split_ledger_is_still_read(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path)
    paths.legacy_events.write_text('{"ts": 1, "event": "submitted", "job_id": "3"}\n')
    Ledger(paths, role="cli").append("stop_requested")
    assert [e.event for e in read_events(paths).events] == [
        "submitted",
        "stop_requested",
    ]


def test_outcome_round_trip(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path)
    assert read_outcome(paths, "9.0") is None
    write_outcome(
        paths, "9.0", AttemptOutcome("stopped", "timeout", 40, world_size=2, extra={"params_sha256": "ab"})
    )
    out = read_outcome(paths, "9.0")
    assert out is not None and (out.status, out.cause, out.step, out.extra["params_sha256"]) == (
        "stopped",
        "timeout",
        40,
        "ab",
    )


# ---- the lock ------------------------------------------------------------------------------------


def test_a_second_writer_is_refused_naming_the_holder(tmp_path: Path) -> None:
    lock = RunLock(RunPaths(tmp_path))
    lock.acquire(job_id="local123", scheduler="local", role="controller", is_active=None)
    with pytest.raises(RunLockedError, match=r"this run is active: local job local123 \(controller pid \d+"):
        RunLock(RunPaths(tmp_path)).acquire(job_id="fg1", scheduler="local", role="train", is_active=None)


def test_a_dead_process_on_this_host_is_stale_at_once(tmp_path: Path) -> None:
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    pid = int(dead.stdout)
    lock = RunLock(RunPaths(tmp_path))
    holder = lock.acquire(job_id="fg1", scheduler="local", role="train", is_active=None)
    lock.set(replace(holder, pid=pid))  # as if that (now dead) process held it
    mine = lock.acquire(job_id="fg2", scheduler="local", role="train", is_active=None)
    assert lock.read() == mine


def test_a_queued_job_is_alive_while_its_scheduler_says_so(tmp_path: Path) -> None:
    lock = RunLock(RunPaths(tmp_path))
    holder = lock.acquire(job_id="123", scheduler="slurm", role="job", is_active=None)
    old = replace(holder, heartbeat=time.time() - STALE_AFTER_S - 1, host="login9", pid=0)
    lock.set(old)
    assert holder_alive(old, is_active=lambda h: True)
    with pytest.raises(RunLockedError, match=r"slurm job 123 \(queued"):
        lock.acquire(job_id="", scheduler="slurm", role="job", is_active=lambda h: h.job_id == "123")
    # the scheduler has forgotten it: stale, taken over
    lock.acquire(job_id="", scheduler="slurm", role="job", is_active=lambda h: False)


def test_a_fresh_heartbeat_from_another_host_is_alive(tmp_path: Path) -> None:
    lock = RunLock(RunPaths(tmp_path))
    holder = lock.acquire(job_id="9", scheduler="pbs", role="agent", is_active=None)
    lock.set(replace(holder, host="othernode"))
    with pytest.raises(RunLockedError):
        lock.acquire(job_id="", scheduler="pbs", role="job", is_active=lambda h: False)


def test_heartbeat_hand_over_and_release(tmp_path: Path) -> None:
    lock = RunLock(RunPaths(tmp_path))
    holder = lock.acquire(job_id="5", scheduler="pbs", role="agent", is_active=None)
    before = lock.read()
    assert before is not None
    time.sleep(0.01)
    assert lock.heartbeat(holder)
    after = lock.read()
    assert after is not None and after.heartbeat > before.heartbeat
    lock.hand_over(holder, "6.pbshead")
    handed = lock.read()
    assert handed is not None and (handed.job_id, handed.role) == ("6.pbshead", "job")
    assert not lock.heartbeat(holder)  # no longer ours
    lock.release(handed)
    assert lock.read() is None and not any(p.name.startswith(".lock") for p in tmp_path.iterdir())


def test_an_unreadable_lock_goes_stale_by_its_age_whatever_the_scheduler_says(tmp_path: Path) -> None:
    """No heartbeat to trust: the file's modification time stands in for one. It used to be
    alive forever when a scheduler was asked about its (unparseable) job."""
    paths = RunPaths(tmp_path)
    paths.lock.write_text("{not json")
    with pytest.raises(RunLockedError, match="unreadable lock file"):
        RunLock(paths).acquire(job_id="1", scheduler="local", role="train", is_active=lambda h: True)
    old = time.time() - 2 * STALE_AFTER_S
    os.utime(paths.lock, (old, old))
    RunLock(paths).acquire(job_id="1", scheduler="local", role="train", is_active=lambda h: True)
    assert json.loads(paths.lock.read_text())["job_id"] == "1"


def test_only_one_of_two_racing_writers_gets_the_lock(tmp_path: Path) -> None:
    code = (
        "import sys; from pathlib import Path\n"
        "from hpclaunch.rundir import RunLock, RunPaths\n"
        "from hpclaunch.errors import RunLockedError\n"
        "try:\n"
        "    RunLock(RunPaths(Path(sys.argv[1]))).acquire(job_id=sys.argv[2], scheduler='local', role='controller', is_active=None)\n"
        "    print('got'); import time; time.sleep(2)\n"
        "except RunLockedError: print('refused')\n"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(tmp_path), f"j{i}"], stdout=subprocess.PIPE, text=True
        )
        for i in range(4)
    ]
    results = sorted(p.communicate()[0].strip() for p in procs)
    assert results == ["got", "refused", "refused", "refused"], results
    assert os.path.exists(tmp_path / "lock.json")


# ---- node verdicts ---------------------------------------------------------------------------------


def test_a_data_check_failing_everywhere_is_the_data_not_the_nodes() -> None:
    bad = "tokens/shard_00001.npz: not a readable .npz archive"
    v = Verdicts([NodeVerdict(0, "n1", False, "data", bad), NodeVerdict(1, "n2", False, "data", bad)])
    assert v.data_error == bad and v.failed_nodes == {}


def test_a_data_check_failing_on_one_node_is_that_node() -> None:
    v = Verdicts(
        [NodeVerdict(0, "n1", True), NodeVerdict(1, "n2", False, "data", "data.token_dir does not exist")]
    )
    assert v.data_error is None and list(v.failed_nodes) == ["n2"]


def test_each_kind_reads_as_its_type_and_an_unknown_kind_as_a_plain_event() -> None:
    started = parse_event({"event": "started", "ts": 5, "attempt": "7.0", "node": 0, "hosts": ["a", "b"]})
    assert isinstance(started, Started) and started.hosts == ["a", "b"] and started.ts == 5
    # a field of the wrong JSON type (a damaged line) is read as missing, not trusted
    saved = parse_event({"event": "checkpoint_saved", "step": "12", "blocking": 1})
    assert isinstance(saved, CheckpointSaved) and saved.step is None and saved.blocking is None
    # a newer writer's kind and fields: readable, kept as written
    newer = parse_event({"event": "from_the_future", "ts": 1.5, "attempt": "7.1", "extra": {"x": 1}})
    assert type(newer) is Event and newer.attempt == "7.1" and newer.record["extra"] == {"x": 1}
    assert as_events([{"event": "started"}, newer])[1] is newer


def test_one_process_events_in_one_millisecond_read_in_the_order_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A foreground ``train`` (or a bench) writes the CLI's ``submitted`` and the agent's ``started``
    within one millisecond; ordered by file name, ``agent0-...`` came first and the submission
    seemed to follow the attempt (the rescue then read the attempt as decided)."""
    import hpclaunch.rundir.ledger as ledger_mod

    monkeypatch.setattr(ledger_mod.time, "time", lambda: 1000.0)
    paths = RunPaths(tmp_path).ensure()
    Ledger(paths, role="cli").append("submitted", job_id="21")
    Ledger(paths, role="agent", attempt="21.0", node=0).append("started", job_id="21")
    Ledger(paths, role="cli").append("cancelled")
    assert [e.event for e in read_events(paths).events] == ["submitted", "started", "cancelled"]
