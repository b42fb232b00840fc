"""Issue 36, finding 5: a node's death is known by the first evidence. Before, only the heartbeat
window told it (8 s of an unchanged counter: 7.81 of the 9.82 s from the death of a node to its
spare's first step on real SLURM). Now each agent holds a TCP connection to the agents it watches,
and the kernel closes a dead agent's end at once. The agents here are real processes, killed with
SIGKILL or stopped with SIGSTOP; the observer's clock is a fake that never moves, so that nothing
here can be the heartbeat window's doing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.runlib import wait_for

from hpclaunch.jobs.allocation import Allocation, await_reports
from hpclaunch.rundir import RunPaths

pytestmark = pytest.mark.spawns

HOSTS = ("n1", "n2", "n3")
AGENT = """
import sys, time
from hpclaunch.jobs.allocation import Allocation
from hpclaunch.rundir import RunPaths
from pathlib import Path
a = Allocation(RunPaths(Path(sys.argv[1])), "7.0", sys.argv[2], ("n1", "n2", "n3"))
a.start_beating()
a.listen("127.0.0.1")
print("ready", flush=True)
time.sleep(3600)
"""


class Frozen:
    """The observer's monotonic clock, which does not move: no heartbeat window can pass."""

    def __call__(self) -> float:
        return 1000.0


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", AGENT, str(tmp_path), "n2"], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    yield proc
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)


def observer(tmp_path: Path) -> Allocation:
    a = Allocation(RunPaths(tmp_path), "7.0", "n1", HOSTS, clock=Frozen())
    a.listen("127.0.0.1")
    return a


def test_an_agent_killed_is_dead_at_once_not_after_the_heartbeat_window(
    tmp_path: Path, agent: subprocess.Popen[str]
) -> None:
    me = observer(tmp_path)
    me.watch(["n2"])
    assert me.alive("n2") and not me.known_dead("n2")
    os.kill(agent.pid, signal.SIGKILL)
    agent.wait(timeout=60)
    wait_for(lambda: not me.alive("n2"), timeout=60, poll=0.05, what="n2 known dead")
    assert me.known_dead("n2")  # and it stays so
    me.stop_beating()


def test_a_stopped_agent_is_silent_not_dead_the_heartbeat_window_decides(
    tmp_path: Path, agent: subprocess.Popen[str]
) -> None:
    """SIGSTOP (a GC pause, a hung NFS client, a node whose kernel hangs): its connection stays
    open, so no evidence comes; only the heartbeat window may call it gone (and fencing makes that
    safe when it comes back)."""
    me = observer(tmp_path)
    me.watch(["n2"])
    os.kill(agent.pid, signal.SIGSTOP)
    try:
        for _ in range(20):
            assert me.alive("n2") and not me.known_dead("n2")
    finally:
        os.kill(agent.pid, signal.SIGCONT)
    me.stop_beating()


def test_a_broken_connection_to_a_live_agent_is_no_death(tmp_path: Path) -> None:
    """A connection that ends while the agent still listens (a reset on the way) is reconnected."""
    live = Allocation(RunPaths(tmp_path), "7.0", "n2", HOSTS)
    live.listen("127.0.0.1")
    me = observer(tmp_path)
    me.watch(["n2"])
    assert live._listener is not None
    wait_for(lambda: bool(live._listener._held), timeout=60, poll=0.05, what="the connection")  # type: ignore[union-attr]
    for conn in live._listener._held:
        conn.close()

    def reconnected() -> bool:
        assert me.alive("n2") and not me.known_dead("n2")  # never dead meanwhile
        return len(live._listener._held) >= 2  # type: ignore[union-attr]

    wait_for(reconnected, timeout=60, poll=0.05, what="a reconnection")
    me.stop_beating()
    live.stop_beating()


def test_the_decider_stops_waiting_for_a_dead_nodes_report_at_once(
    tmp_path: Path, agent: subprocess.Popen[str]
) -> None:
    """``await_reports``: n2 never reports; before, the decider waited out DEAD_AFTER_S of n2's
    unchanged counter (its clock here never moves: it would wait for ever)."""
    me = observer(tmp_path)
    me.report("7.0", 0, {"state": "failed", "returncode": 1})
    os.kill(agent.pid, signal.SIGKILL)
    agent.wait(timeout=60)
    dead, stuck = await_reports(me, "7.0", {0: "n1", 1: "n2"}, clock=Frozen())
    assert (dead, stuck) == (("n2",), ())
    me.stop_beating()
