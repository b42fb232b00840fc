"""Issue 36, finding 4: an agent slow to start at 512 nodes is not gone while the start barrier
still waits for it; chain retries are bounded and quiet."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpclaunch.jobs import node_checks
from hpclaunch.jobs.allocation import Allocation
from hpclaunch.jobs.node_checks import NodeVerdict, StartBarrier
from hpclaunch.rundir import RunPaths

pytestmark = pytest.mark.fast


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s


def test_a_node_whose_agent_starts_late_is_waited_for_as_long_as_the_gather_waits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: an agent with no heartbeat yet was "gone" 60 s after the decider first looked
    (START_GRACE_S), while the gather waited 180 s: at 512 nodes, a node whose agent took two
    minutes to start (a cold Python on a shared filesystem) failed its checks as "its agent is
    gone" and was replaced."""
    clock = Clock()
    monkeypatch.setattr(node_checks.time, "sleep", clock.sleep)
    paths = RunPaths(tmp_path).ensure()
    decider = Allocation(paths, "7.0", "n1", ("n1", "n2"), clock=clock)
    decider.beats.mkdir(parents=True, exist_ok=True)
    barrier = StartBarrier(paths, "7.0", clock=clock)
    began = clock.t
    late = Allocation(paths, "7.0", "n2", ("n1", "n2"))

    def gone(host: str) -> bool:
        if clock.t - began >= 150 and not (late.beats / "n2").exists():  # n2's agent is up at last
            late.beat()
            barrier.report(NodeVerdict(1, "n2", True))
        return not decider.alive(host)

    verdicts = barrier.gather({1: "n2"}, gone=gone)
    assert verdicts.ok, verdicts.nodes
