"""Issue 36, finding 3 (second half): every external command has a deadline that holds.

Before, ``subprocess.run(timeout=...)`` sent SIGKILL to the command alone and then waited for it to
exit, without a limit: a command in D-state (``nvidia-smi`` in a wedged driver) exits only when it
leaves the kernel, so the node checks, and the decider with them, waited for ever; and what the
command had started outlived it. The commands here really run and sleep for an hour, so a wait
that does not hold cannot pass."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hpclaunch import proc
from hpclaunch.config import RunConfig
from hpclaunch.errors import SchedulerError
from hpclaunch.jobs import node_checks
from hpclaunch.orchestrator.plan_build import build
from hpclaunch.preflight.check_context import run_command
from hpclaunch.schedulers.protocol import NodeContext
from hpclaunch.schedulers.protocol import run_command as scheduler_command

# Far below the hour the commands sleep, far above any deadline here plus KILL_GRACE_S on a
# loaded machine: a call still waiting when it passes is one whose deadline did not hold.
BOUND_S = 90.0


def returns(call: Callable[[], Any]) -> tuple[bool, Any]:
    """Whether ``call()`` came back within BOUND_S, and what it answered (or raised)."""
    out: list[Any] = []

    def target() -> None:
        try:
            out.append(call())
        except BaseException as e:
            out.append(e)

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(BOUND_S)
    return (not t.is_alive(), out[0] if out else None)


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] == "Z"
    except (FileNotFoundError, IndexError):
        return True


@pytest.fixture
def pidfile(tmp_path: Path) -> Any:
    path = tmp_path / "pids"
    yield path
    for line in path.read_text().split() if path.exists() else []:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(line), signal.SIGKILL)


@pytest.mark.spawns
def test_what_a_command_started_dies_with_it_at_its_deadline(pidfile: Path) -> None:
    """Before: only the command itself was killed; what it had started ran on."""
    script = f"sleep 3600 & echo $! >> {pidfile}; sleep 3600"
    came_back, answer = returns(lambda: proc.run(["sh", "-c", script], timeout=0.5))
    assert came_back, "the call waited past its deadline"
    assert isinstance(answer, subprocess.TimeoutExpired)
    grandchild = int(pidfile.read_text().split()[0])
    deadline = time.monotonic() + BOUND_S
    while not gone(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gone(grandchild), "the command's group outlived its deadline"


@pytest.fixture
def sigkill_does_not_take(monkeypatch: pytest.MonkeyPatch) -> None:
    """A process in D-state (``nvidia-smi`` inside a wedged driver) ignores SIGKILL until it leaves
    the kernel. That state cannot be made here, so the kill is made to do nothing instead."""
    monkeypatch.setattr(os, "killpg", lambda pid, sig: None)
    monkeypatch.setattr(subprocess.Popen, "kill", lambda self: None)


@pytest.mark.spawns
def test_a_node_check_whose_command_sigkill_cannot_reach_ends_at_its_deadline_fake_d_state(
    pidfile: Path, sigkill_does_not_take: None
) -> None:
    """Before: ``subprocess.run`` waited for the killed command to exit, for ever."""
    script = f"echo $$ >> {pidfile}; exec sleep 3600"
    came_back, answer = returns(lambda: run_command(["sh", "-c", script], 0.5))
    assert came_back, "the node check waited for a command that SIGKILL did not end"
    assert answer is not None and answer.returncode == 124 and "did not answer within" in answer.stderr


@pytest.mark.spawns
def test_a_scheduler_command_sigkill_cannot_reach_is_a_scheduler_error_at_its_deadline_fake_d_state(
    pidfile: Path, sigkill_does_not_take: None
) -> None:
    script = f"echo $$ >> {pidfile}; exec sleep 3600"
    came_back, answer = returns(
        lambda: scheduler_command(["sh", "-c", script], what="scontrol release", hint="", timeout=0.5)
    )
    assert came_back, "the scheduler command waited past its deadline"
    assert isinstance(answer, SchedulerError) and "did not answer within" in str(answer)


@pytest.mark.spawns
def test_a_command_that_answers_in_time_is_read_whole() -> None:
    done = proc.run(["sh", "-c", "echo out; echo err >&2; exit 3"], timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (3, "out\n", "err\n")


@pytest.mark.fast
def test_node_checks_stuck_in_the_kernel_fail_the_node_at_their_deadline_fake_stuck_check(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A check blocked in a system call (``statvfs`` of a hung mount: faked, it cannot be made here)
    no longer holds the agent: the node fails its checks, and a spare can take its place."""
    release = threading.Event()

    def stuck(*args: Any, **kwargs: Any) -> Any:
        release.wait(BOUND_S)
        raise AssertionError("the agent waited for a stuck check")

    import hpclaunch.preflight as preflight

    monkeypatch.setattr(preflight, "run_node_checks", stuck)
    monkeypatch.setattr(node_checks, "CHECKS_DEADLINE_S", 0.2)
    cfg = RunConfig.model_validate({"name": "t", "scheduler": {"kind": "local"}})
    ctx = NodeContext("local", "1", 0, 1, "n1", ("n1",))
    try:
        verdict, rows = node_checks.run_checks(build(cfg, python="python3"), cfg, ctx)
    finally:
        release.set()
    assert not verdict.ok and verdict.check == "deadline"
    assert "did not finish within" in (verdict.finding or "") and rows[0]["status"] == "fail"
