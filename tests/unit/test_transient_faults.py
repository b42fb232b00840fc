"""Issue 36, finding 3 (first half) and 4 (node 0's FAILED): a transient filesystem error on a
control-plane read is read again a bounded number of times and never ends an agent; an agent that
does leave on an error that is not the run's records why and does not end the run; only the agent
that decides ends a run.

ESTALE and EIO cannot be made on a local filesystem: the reads below go to real files, and the
errors are injected into them (``injected`` in each test's name) a given number of times."""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hpclaunch.errors import ConfigError
from hpclaunch.jobs.agent_exit import agent_failed
from hpclaunch.jobs.allocation import Allocation
from hpclaunch.jobs.node_checks import NodeVerdict, StartBarrier
from hpclaunch.rundir import Ledger, RunPaths, read_events

pytestmark = pytest.mark.fast

HOSTS = ("n1", "n2")


class Flaky:
    """Makes the calls on paths whose name contains ``name`` fail with ``err`` ``times`` times."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, name: str, err: int, times: int) -> None:
        self.name, self.err, self.left = name, err, times
        real_read, real_stat = Path.read_text, os.stat

        def read_text(path: Path, *args: Any, **kwargs: Any) -> str:
            self._maybe(path)
            return real_read(path, *args, **kwargs)

        def stat(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
            self._maybe(path)
            return real_stat(path, *args, **kwargs)

        monkeypatch.setattr(Path, "read_text", read_text)
        monkeypatch.setattr(os, "stat", stat)
        monkeypatch.setattr("hpclaunch.fsutil.time.sleep", lambda s: None)  # the retries' pauses

    def _maybe(self, path: Any) -> None:
        if self.name in os.fspath(path) and self.left > 0:
            self.left -= 1
            raise OSError(self.err, os.strerror(self.err), os.fspath(path))


@pytest.fixture
def alloc(tmp_path: Path) -> Iterator[Allocation]:
    paths = RunPaths(tmp_path).ensure()
    a = Allocation(paths, "7.0", "n1", HOSTS)
    yield a


def test_an_estale_burst_on_the_decision_is_read_through_injected(
    alloc: Allocation, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: the ESTALE escaped ``Allocation.decision`` and ended the waiting agent."""
    record = {"attempt": "7.0", "action": "finish", "cause": None, "in_place": False, "by": "n1"}
    assert alloc.publish("7.0", record)  # type: ignore[arg-type]
    Flaky(monkeypatch, "decision.json", errno.ESTALE, times=2)
    assert alloc.decision("7.0") == record


def test_eio_for_ever_on_the_control_files_is_not_yet_never_an_agent_death_injected(
    alloc: Allocation, monkeypatch: pytest.MonkeyPatch
) -> None:
    alloc.report("7.0", 1, {"state": "failed", "returncode": 1})
    alloc.signal_end("7.0", "node n2: failed")
    alloc.publish("7.0", {"attempt": "7.0", "action": "finish", "cause": None, "in_place": False, "by": "n1"})
    Flaky(monkeypatch, "7.0", errno.EIO, times=10**6)
    assert alloc.decision("7.0") is None  # not yet: the next poll reads again
    assert alloc.reports("7.0", [1]) == {}
    assert alloc.ended("7.0") is False


def test_the_end_file_and_a_report_are_read_through_a_burst_injected(
    alloc: Allocation, monkeypatch: pytest.MonkeyPatch
) -> None:
    alloc.report("7.0", 1, {"state": "failed", "returncode": 1})
    alloc.signal_end("7.0", "node n2: failed")
    Flaky(monkeypatch, "7.0", errno.ESTALE, times=2)
    assert alloc.ended("7.0")
    Flaky(monkeypatch, "node1.done.json", errno.ESTALE, times=2)
    assert alloc.reports("7.0", [1])[1]["state"] == "failed"


def test_the_start_barrier_reads_through_a_burst_injected(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: ``wait_go`` and the gather's reads let ESTALE through (node_checks.py:203, 211-216)."""
    barrier = StartBarrier(RunPaths(tmp_path).ensure(), "7.0")
    barrier.report(NodeVerdict(1, "n2", True))
    (barrier.dir / "go.json").write_text(json.dumps({"go": True, "reason": "", "roster": None}))
    Flaky(monkeypatch, "go.json", errno.ESTALE, times=2)
    assert barrier.wait_go(timeout_s=60).go
    Flaky(monkeypatch, "node1.json", errno.EIO, times=2)
    assert barrier.gather({1: "n2"}, timeout_s=60).ok


def test_a_ledger_file_unreadable_for_a_moment_is_read_again_not_left_out_injected(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A writer's file missing from the merge would undercount the budgets the decider reads."""
    paths = RunPaths(tmp_path).ensure()
    Ledger(paths, role="agent", attempt="7.0", node=1).append("requeued", cause="crash")
    Flaky(monkeypatch, "agent1-", errno.ESTALE, times=2)
    log = read_events(paths)
    assert [e.event for e in log.events] == ["requeued"] and log.torn == []


# ---- how an agent leaves ------------------------------------------------------------------------


def kinds(paths: RunPaths) -> list[str]:
    return [e.event for e in read_events(paths).events]


def test_a_filesystem_error_that_outlasts_its_retries_ends_the_agent_not_the_run(tmp_path: Path) -> None:
    """Before: ``agent_main`` caught only HpclaunchError; the OSError's traceback ended the agent
    with nothing recorded, and on the batch host the rescue then blamed the node."""
    paths = RunPaths(tmp_path).ensure()
    error = OSError(errno.ESTALE, os.strerror(errno.ESTALE), str(paths.root / "agents"))
    assert agent_failed(paths, 0, error, decides=True, attempt="7.0") == 1
    (said,) = read_events(paths).events
    assert said.event == "agent_error" and said.record["errno"] == "ESTALE"
    assert said.attempt == "7.0" and "filesystem error ESTALE" in said.record["error"]


@pytest.mark.parametrize(
    ("node", "decides", "ends_run"),
    [
        (0, None, True),  # node 0 failed before any role was known: it is the decider
        (0, True, True),
        (0, False, False),  # node 0 left the roster or was deposed: the role had moved (agent.py:352)
        (2, True, True),  # node 2's agent had taken the role over: it ends the run
        (2, False, False),
        (2, None, False),
    ],
)
def test_only_the_agent_that_decides_ends_the_run(
    tmp_path: Path, node: int, decides: bool | None, ends_run: bool
) -> None:
    paths = RunPaths(tmp_path).ensure()
    agent_failed(paths, node, ConfigError("bad sweep point"), decides=decides)
    assert kinds(paths) == (["failed"] if ends_run else ["agent_error"])


def test_a_report_is_written_through_a_long_burst_injected(
    alloc: Allocation, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node's report (and a decision, a verdict) must land: its writes try for about 20 s, not
    5 times (the 512-agent fault bench lost agents to ESTALE on their report before)."""
    real = os.replace

    class Burst:
        left = 8

    def replace(src: Any, dst: Any) -> None:
        if "node1.done.json" in os.fspath(dst) and Burst.left > 0:
            Burst.left -= 1
            raise OSError(errno.ESTALE, os.strerror(errno.ESTALE))
        real(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr("hpclaunch.fsutil.time.sleep", lambda s: None)
    alloc.report("7.0", 1, {"state": "failed", "returncode": 1})
    assert alloc.reports("7.0", [1])[1]["state"] == "failed" and Burst.left == 0
