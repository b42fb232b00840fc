"""Issue 49, L7: waits without a deadline on a file that cannot be read, and a ledger write that a
filesystem's hiccup lost.

- ``StartBarrier.announce`` and ``Decider.wait_published`` read a file another writer's exclusive
  create made (``go.json``, ``decision.json``) until it could be read: for ever, when it never could.
  Now for ``STANDING_READ_S``, then an ``OSError`` (an agent error: the role moves on).
- ``Ledger.append`` retried ``open()`` but not ``write()``: an EIO on the write lost the event.

The files are real; the clock is the test's; the refused write is simulated (no filesystem here
returns EIO on demand), named so."""

from __future__ import annotations

import errno
import json
import os
import time
import types
from pathlib import Path
from typing import Any

import pytest
from tests.unit.fencing_child import FakeScheduler, decider

from hpclaunch.jobs import node_checks
from hpclaunch.jobs.node_checks import StartBarrier
from hpclaunch.rundir import Ledger, RunPaths, read_events
from hpclaunch.rundir import ledger as ledger_mod

pytestmark = pytest.mark.fast


class Ticking:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 30.0
        return self.now


@pytest.fixture
def bounded_sleep(monkeypatch: pytest.MonkeyPatch) -> None:
    """The module's pauses cost nothing, and a wait that never ends fails instead of hanging."""
    slept: list[float] = []

    def sleep(s: float) -> None:
        slept.append(s)
        if len(slept) > 10_000:
            raise AssertionError("waited for ever on a file that cannot be read")

    monkeypatch.setattr(node_checks, "time", types.SimpleNamespace(sleep=sleep, monotonic=time.monotonic))


def test_a_go_word_that_stays_unreadable_ends_the_wait_with_an_error(
    tmp_path: Path, bounded_sleep: None
) -> None:
    paths = RunPaths(tmp_path).ensure()
    barrier = StartBarrier(paths, "7.0", clock=Ticking())
    (paths.attempt_dir("7.0")).mkdir(parents=True, exist_ok=True)
    (paths.attempt_dir("7.0") / "go.json").write_text('{"go": tr')  # another decider's, torn for good
    with pytest.raises(OSError) as e:
        barrier.announce(go=True, roster={"training": ["n1"], "spares": []})
    assert e.value.errno == errno.EIO and "go.json" in str(e.value)


def test_a_published_decision_that_stays_unreadable_ends_the_wait_with_an_error(
    tmp_path: Path, bounded_sleep: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = decider(tmp_path, 0, FakeScheduler(tmp_path))
    monkeypatch.setattr(node_checks, "STANDING_READ_S", 0.0)
    path = d.node.alloc.decision_file(d.node.attempt)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("{")
    with pytest.raises(OSError, match=r"decision\.json"):
        d.wait_published()


def test_a_ledger_write_refused_once_is_written_again_whole_simulated_eio(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    paths = RunPaths(tmp_path).ensure()
    ledger = Ledger(paths, role="agent", attempt="7.0")
    ledger.append("node_replaced", nodes=["n2"], spare="n3", reason="before")
    real_write = os.write
    refused: list[int] = []

    def write_half_then_eio(fd: int, data: Any) -> int:
        if not refused:  # the first try: half of the line lands, then the server answers EIO
            refused.append(real_write(fd, bytes(data)[: len(data) // 2]))
            raise OSError(errno.EIO, "Input/output error")
        return real_write(fd, data)

    monkeypatch.setattr(ledger_mod.os, "write", write_half_then_eio)
    monkeypatch.setattr(ledger_mod, "retry_transient", _no_pause_retry)
    ledger.append("node_excluded", nodes=["n2"], reason="the one that was refused")
    monkeypatch.setattr(ledger_mod.os, "write", real_write)
    ledger.append("node_replaced", nodes=["n4"], spare="n5", reason="after")
    log = read_events(paths)
    kinds = [(e.event, e.record.get("reason")) for e in log.events]
    assert kinds == [
        ("node_replaced", "before"),
        ("node_excluded", "the one that was refused"),
        ("node_replaced", "after"),
    ]
    assert len(log.torn) == 1  # the half line, on a line of its own
    lines = ledger.path.read_text().splitlines()
    assert json.loads(lines[-1])["reason"] == "after"


def _no_pause_retry(work: Any, **_: Any) -> Any:
    from hpclaunch.fsutil import retry_transient

    return retry_transient(work, first_delay_s=0.0)
