"""An idle-priority writer starved of CPU by other processes: the waiting rank sees it (the kernel's
run-queue time, not wall-clock guesses) and writes the save again at writer_nice. Real processes
throughout: a busy loop pinned to one core starves a SCHED_IDLE process pinned beside it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from tests.unit.test_checkpoint_writer_process import make

from hpclaunch.rank.checkpoint.starvation import StarvationWatch, run_queue_seconds
from hpclaunch.rundir import CHECKPOINT_WRITER_STARVED, RunPaths, read_events

pytestmark = pytest.mark.skipif(
    not (
        sys.platform.startswith("linux")
        and hasattr(os, "SCHED_IDLE")
        and os.path.exists("/proc/self/schedstat")
    ),
    reason="SCHED_IDLE and the kernel's run-queue accounting are Linux's",
)

BUSY = "while True: pass"
IDLE_BUSY = "import os; os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))\nwhile True: pass"


def _pin(pid: int, cpu: int) -> None:
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), {cpu})
        except (ProcessLookupError, OSError):
            continue


@pytest.fixture
def hog() -> Iterator[int]:
    """A busy loop at normal priority pinned to one of our cores; yields that core."""
    cpu = min(os.sched_getaffinity(0))
    proc = subprocess.Popen([sys.executable, "-c", BUSY])
    _pin(proc.pid, cpu)
    try:
        yield cpu
    finally:
        proc.kill()
        proc.wait()


def _watch_until(watch: StarvationWatch, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if watch.starved():
            return True
        time.sleep(0.2)
    return False


def test_an_idle_process_beside_a_busy_loop_is_starved(hog: int) -> None:
    proc = subprocess.Popen([sys.executable, "-c", IDLE_BUSY])
    try:
        _pin(proc.pid, hog)
        watch = StarvationWatch(proc.pid, patience_s=1.0)
        assert _watch_until(watch, 60.0)
        assert watch.last_share is not None and watch.last_share >= 0.5
    finally:
        proc.kill()
        proc.wait()


def test_a_process_that_waits_on_something_else_is_not_starved() -> None:
    # Not runnable (as a writer waiting for the disk): whatever the machine's load, no run-queue time.
    proc = subprocess.Popen(["sleep", "30"])
    try:
        watch = StarvationWatch(proc.pid, patience_s=1.0)
        assert not _watch_until(watch, 3.0)
        assert watch.last_share is not None and watch.last_share < 0.5
    finally:
        proc.kill()
        proc.wait()


def test_a_process_that_is_gone_cannot_be_called_starved() -> None:
    proc = subprocess.Popen(["true"])
    proc.wait()
    assert run_queue_seconds(proc.pid) is None
    assert not StarvationWatch(proc.pid, patience_s=0.0).starved()


def test_a_starved_idle_writer_is_replaced_at_writer_nice_and_its_save_lands(
    tmp_path: Path, hog: int
) -> None:
    ck = make(tmp_path, writer_idle=True, writer_nice=5)
    state = {"model": {"w": torch.arange(4096, dtype=torch.float32).reshape(64, 64)}}
    try:
        ck.save(7, state, blocking=False)
        starved_pid = ck.writer_pid
        assert starved_pid is not None
        _pin(starved_pid, hog)  # it shares one core with the busy loop, at idle priority
        ck.wait()
        new_pid = ck.writer_pid
        assert new_pid is not None and new_pid != starved_pid
        with pytest.raises(ProcessLookupError):
            os.kill(starved_pid, 0)
        assert os.sched_getscheduler(new_pid) == os.SCHED_OTHER
        assert os.getpriority(os.PRIO_PROCESS, new_pid) == os.getpriority(os.PRIO_PROCESS, 0) + 5
        starved = [e.record for e in read_events(RunPaths(tmp_path)).named(CHECKPOINT_WRITER_STARVED)]
        assert len(starved) == 1 and starved[0]["step"] == 7 and starved[0]["nice"] == 5
        assert starved[0]["run_queue_share"] >= 0.5
        names = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
        assert names == ["step_000007"]  # published; the half-written directory was removed
        loaded = {"model": {"w": torch.zeros(64, 64)}}
        result = ck.load_latest(loaded)
        assert result is not None and result.info.step == 7
        assert torch.equal(loaded["model"]["w"], state["model"]["w"])
        # the next save keeps the writer at writer_nice: no second replacement
        ck.save(8, state, blocking=False)
        ck.wait()
        assert ck.writer_pid == new_pid
    finally:
        ck.close()


@pytest.mark.parametrize("answered", [True, False], ids=["its answer came", "killed before it answered"])
def test_a_writer_found_starved_after_it_published_settles_the_save_as_published(
    tmp_path: Path, answered: bool
) -> None:
    """The ranks agree on "starved" while the coordinator's writer has published already (it was
    starved between the rename and its answer): no second write, no failure, the save is recorded."""
    from hpclaunch.rank.checkpoint.background import ProcessBackground
    from hpclaunch.rundir import CHECKPOINT_SAVED

    ck = make(tmp_path)  # normal priority: its answer must come on a loaded machine too
    try:
        ck.save(5, {"w": torch.ones(8)}, blocking=False)
        bg = ck._background
        assert isinstance(bg, ProcessBackground) and bg._proc is not None
        deadline = time.monotonic() + 300
        while bg._proc.poll(0.0) is None:  # the writer published and answered
            assert time.monotonic() < deadline, "the writer never answered"
            time.sleep(0.05)
        assert (tmp_path / "ckpt" / "step_000005").is_dir()
        if not answered:
            bg._proc.take()  # as if it had been killed between the rename and its answer
        settled = bg._replace_starved_writer(None)
        assert settled is not None and settled.error is None
        assert settled.published is not None and settled.published.step == 5
        assert settled.published.bytes > 0
        assert not ck.pending and ck.writer_pid is None  # stopped, and no second write started
        ck._settle(settled)
        saved = [e.record for e in read_events(RunPaths(tmp_path)).named(CHECKPOINT_SAVED)]
        assert [e["step"] for e in saved] == [5]
        assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step_000005"]
    finally:
        ck.close()
