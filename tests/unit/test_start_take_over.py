"""Issue 49, L3: the start barrier when the decider dies during the node checks.

- ``wait_go`` began its 3600 s again after each failed take-over: a node whose take-overs kept
  failing (another agent claimed the role, which then died too) waited for ever. One deadline now.
- A decider that took the role over at the start barrier never ran admission: a run that had ended
  trained on, and an attempt left undecided stayed so. It admits the attempt now when node 0's agent
  died before it could (the run lock still the queued job's).

A real node agent of a two-node SLURM allocation in this process (its lock, ledger and start
barrier real); the scheduler, which is not asked here but to withdraw, a fake; the barrier's clock
the test's."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest
from tests.unit.fencing_child import FakeScheduler

from hpclaunch.config import load_config
from hpclaunch.jobs import agent as agent_mod
from hpclaunch.jobs.agent import NodeAgent
from hpclaunch.jobs.node_checks import NodeVerdict, StartBarrier
from hpclaunch.orchestrator.plan_build import build
from hpclaunch.rundir import FINISHED, STARTED, Ledger, LockHolder, RunLock, RunPaths, read_events
from hpclaunch.schedulers.protocol import NodeContext

pytestmark = pytest.mark.fast

HOSTS = ("n1", "n2")


class Withdrawing(FakeScheduler):
    def withdraw(self, paths: Any, ctx: Any) -> str:
        self._call(call="withdraw", job=ctx.job_id)
        return f"cancelled job {ctx.job_id}"

    def node_address(self, host: str) -> str:
        return "127.0.0.1"


class Ticking:
    """The barrier's clock: a minute passes at every look."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 60.0
        return self.now


@pytest.fixture
def agent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> NodeAgent:
    """n2's agent (node 1) of job 7, whose node 0 (n1) died during the checks."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)
    cfg = load_config(None, ["scheduler.kind=slurm", "scheduler.nodes=2", f"run_dir={tmp_path / 'run'}"])
    paths = RunPaths(tmp_path / "run").ensure()
    ctx = NodeContext("slurm", "7", 1, 2, "n2", HOSTS)
    a = NodeAgent(paths, build(cfg, python="python3"), ctx, Withdrawing(tmp_path), cfg)  # type: ignore[arg-type]
    a.role.beat_every_s = 3600.0
    monkeypatch.setattr(a, "_node_checks", lambda: NodeVerdict(1, "n2", True))
    return a


def queued_lock(paths: RunPaths) -> None:
    """The lock as the submission left it: the queued job's (node 0 never adopted it)."""
    RunLock(paths)._claim(0, LockHolder("7", "slurm", "job", "login", 0, 1.0, 1.0))


def test_failed_take_overs_do_not_restart_the_wait_for_the_start(
    agent: NodeAgent, monkeypatch: pytest.MonkeyPatch
) -> None:
    tries: list[int] = []

    def lost() -> bool:
        tries.append(1)
        if len(tries) > 1000:
            raise AssertionError("the wait for the start's word began again after every failed take-over")
        return False

    monkeypatch.setattr(agent.role, "gone", lambda roster, every_s=1.0: True)
    monkeypatch.setattr(agent.role, "take_over", lost)
    barrier = StartBarrier(agent.node.paths, agent.attempt, clock=Ticking())
    assert agent._start(barrier) == 0  # no word within the one wait: this node does not start
    assert len(tries) <= agent_mod.GO_WAIT_S / 60


def test_a_decider_taking_over_at_the_start_withdraws_an_attempt_of_a_run_that_ended(
    agent: NodeAgent,
) -> None:
    paths = agent.node.paths
    queued_lock(paths)
    Ledger(paths, role="agent", attempt="6.0").append(FINISHED, reason="done")  # (a requeue after the end)
    refusal = agent._take_over_at_start()
    assert isinstance(refusal, str) and "ended" in refusal
    calls = (paths.root.parent / "calls.jsonl").read_text()
    assert '"withdraw"' in calls
    assert RunLock(paths).read() is None  # the run is left as it ended
    agent.role.close()


def test_a_decider_taking_over_at_the_start_decides_the_attempt_left_undecided(agent: NodeAgent) -> None:
    paths = agent.node.paths
    queued_lock(paths)
    Ledger(paths, role="cli").append("submitted", job_id="6")
    Ledger(paths, role="agent", attempt="6.0", node=0).append(STARTED, job_id="6")  # its agents were killed
    assert agent._take_over_at_start() is True
    decided = [e for e in read_events(paths).events if e.event == "requeued" and e.attempt == "6.0"]
    assert len(decided) == 1 and decided[0].record["cause"] == "preemption"
    holder = RunLock(paths).read()
    assert holder is not None and (holder.job_id, holder.role, holder.host) == ("7", "agent", holder.host)
    assert agent.role.leads and agent.role.fenced()
    agent.role.close()
