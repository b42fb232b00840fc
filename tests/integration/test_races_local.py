"""Issue 16, end to end on the embedded local scheduler: two things at once, for real (the CLI,
the detached controller, the node agent, torchrun with 2 gloo ranks). These tests use only the CLI
and the run directory, so they also run against an older hpclaunch (that is how they were shown
to fail before the fixes)."""

from __future__ import annotations

import io
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
from tests.runlib import TINY, events, hpclaunch, status, synth_data, tiny_overrides, wait_for, wait_run_done

pytestmark = pytest.mark.slow

SLOW = ("train.steps=400", "testing.step_sleep_s=0.25", "train.log_every=1", "checkpoint.every_steps=20")


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("races")


@pytest.fixture(scope="module")
def data(work: Path) -> Path:
    return synth_data(work / "data")


def _submit(work: Path, data: Path, name: str, *extra: str, env: dict[str, str] | None = None) -> Path:
    hpclaunch("submit", str(TINY), *tiny_overrides(work, data, name, *SLOW, *extra), cwd=work, env=env)
    return work / "runs" / name


def _trained(run: Path, steps: int = 1) -> bool:
    path = run / "metrics.jsonl"
    if not path.exists():
        return False
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return bool(lines) and int(lines[-1]["step"]) >= steps


def _agent(run: Path) -> psutil.Process:
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if "hpclaunch.jobs.agent" in cmd and any(str(run) in c for c in cmd):
            return p
    raise LookupError(f"no node agent for {run}")


def _named(run: Path, *names: str) -> list[dict[str, Any]]:
    return [e for e in events(run) if e["event"] in names]


@pytest.mark.parametrize("order", ["stop-then-warning", "warning-then-stop"])
def test_a_user_stop_and_the_schedulers_warning_in_one_attempt_end_the_run(
    work: Path, data: Path, order: str
) -> None:
    """Finding 1: `hpclaunch stop` and the scheduler's warning (SIGUSR2 to the agent, as the local
    scheduler and SLURM's --signal send it) in the same attempt. The run ends, as the user asked;
    before, the warning overwrote the request and the run was requeued as a timeout."""
    run = _submit(work, data, f"stop-warn-{order}")
    wait_for(lambda: _trained(run, 2), timeout=300, poll=0.2, what="training")
    warn = lambda: _agent(run).send_signal(signal.SIGUSR2)  # noqa: E731
    stop = lambda: hpclaunch("stop", str(run), cwd=work)  # noqa: E731
    for act in (stop, warn) if order == "stop-then-warning" else (warn, stop):
        act()
    final = wait_run_done(run, work, timeout=300)
    assert final["state"] == "stopped", final["state"]
    assert final["attempts"][-1]["cause"] == "user"
    requeued = _named(run, "requeued")
    if order == "stop-then-warning":
        assert requeued == []  # never continued
    else:
        # The warning may have stopped the attempt before the request landed; then the next
        # attempt honours the request at once. Either way the user's stop ends the run.
        assert len(requeued) <= 1
        assert not _named(run, "finished")


def test_a_cancel_after_the_attempt_ended_is_never_requeued(work: Path, data: Path) -> None:
    """Finding 6: `hpclaunch cancel` that lands after the trainer exited and before the agent asks
    the scheduler to continue (widened here by a test knob): a cancellation, never a requeue."""
    run = _submit(work, data, "late-cancel", "testing.pause_before_continue_s=8")
    wait_for(lambda: _trained(run, 2), timeout=300, poll=0.2, what="training")
    hpclaunch("stop", str(run), "--continue", cwd=work)
    wait_for(lambda: _named(run, "stopped"), timeout=300, poll=0.2, what="the stop save")
    wait_for(
        lambda: _named(run, "started") and not _agent_alive_torchrun(run), timeout=120, poll=0.2, what="exit"
    )
    hpclaunch("cancel", str(run), cwd=work)
    final = wait_run_done(run, work, timeout=300)
    assert final["state"] == "cancelled", final["state"]
    assert _named(run, "requeued") == []
    assert len({e["attempt"] for e in _named(run, "started")}) == 1


def _agent_alive_torchrun(run: Path) -> bool:
    try:
        return any(
            "torch.distributed.run" in " ".join(c.cmdline()) for c in _agent(run).children(recursive=True)
        )
    except (LookupError, psutil.Error):
        return False


def test_a_late_relay_does_not_stop_the_next_attempt(work: Path, data: Path) -> None:
    """Finding 2: a node agent that relays the previous attempt's SIGTERM after node 0 decided (a
    non-head node, late): the next attempt must train on. Emulated by the request a late relay writes
    (``control/stop.<old attempt>``). The code before the fix had one control file without an
    attempt, which this test cannot write (it is the user's request now): the unit test
    ``test_a_late_nodes_relay_does_not_stop_the_next_attempt`` is the one that fails on that code."""
    run = _submit(work, data, "stale-relay")
    wait_for(lambda: _trained(run, 2), timeout=300, poll=0.2, what="training")
    first = _named(run, "started")[0]["attempt"]
    hpclaunch("stop", str(run), "--continue", cwd=work)
    wait_for(
        lambda: len({e["attempt"] for e in _named(run, "started")}) >= 2,
        timeout=300,
        poll=0.1,
        what="attempt 2",
    )
    control = run / "control"
    relay = {"cause": "preemption", "by": "agent:SIGTERM", "requested_at": time.time(), "attempt": first}
    (control / f"stop.{first}").write_text(json.dumps(relay))
    second_start = _named(run, "started")[-1]["ts"]
    wait_for(
        lambda: _steps_after(run, second_start) >= 15, timeout=300, poll=0.5, what="15 steps of attempt 2"
    )
    assert len(_named(run, "stopped")) == 1  # only the user's stop --continue stopped an attempt
    hpclaunch("cancel", str(run), cwd=work)
    wait_run_done(run, work, timeout=300)


def _steps_after(run: Path, ts: float) -> int:
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return sum(1 for line in lines if float(line.get("ts") or 0) > ts)


def test_a_token_corrupted_mid_run_fails_the_run_as_bad_data_at_once(work: Path, tmp_path: Path) -> None:
    """Finding 8: a shard rewritten while the run trains (after the start-up check vouched for it).
    The batch that reads it names the file: the run's own data failure in the same attempt, never
    a crash retried first."""
    private = synth_data(tmp_path / "data", samples=256)
    run = _submit(work, private, "bad-token", "scheduler.max_failure_retries=2")
    wait_for(lambda: _trained(run, 2), timeout=300, poll=0.2, what="training")
    for shard in sorted((private / "tokens").glob("*.npz")):
        ids = np.load(shard)["input_ids"].copy()
        ids[:, 5] = 999
        rewritten = io.BytesIO()
        np.savez(rewritten, input_ids=ids)
        # In place (same inode, same size): the ranks' memory maps of the shard see it, as they
        # would see a shard a careless job rewrites under a running one.
        assert len(rewritten.getvalue()) == shard.stat().st_size
        with open(shard, "r+b") as f:
            f.write(rewritten.getvalue())
    final = wait_run_done(run, work, timeout=300)
    assert final["state"] == "failed", final["state"]
    assert final["attempts"][-1]["cause"] == "data"
    assert "id 999" in (final["attempts"][-1]["error"] or "")
    assert _named(run, "requeued") == []  # not retried as a crash first


def test_every_writer_keeps_the_lock_alive(work: Path, data: Path) -> None:
    """Finding 4: the local controller and a foreground `train` refresh their heartbeat, so that
    another host sharing the filesystem does not take over a live run after 90 s."""
    env = {"HPCLAUNCH_LOCK_HEARTBEAT_S": "0.5"}
    run = _submit(work, data, "beating", env=env)
    wait_for(lambda: _trained(run, 1), timeout=300, poll=0.2, what="training")
    beats = _heartbeats(run, "controller")
    assert beats[-1] > beats[0]
    hpclaunch("cancel", str(run), cwd=work)
    wait_run_done(run, work, timeout=300)

    import subprocess
    import sys

    fg = work / "runs" / "beating-fg"
    args = tiny_overrides(work, data, "beating-fg", *SLOW)
    proc = subprocess.Popen(
        [sys.executable, "-m", "hpclaunch", "train", str(TINY), *args],
        cwd=work,
        env={**os.environ, **env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for(lambda: _trained(fg, 1), timeout=300, poll=0.2, what="foreground training")
        beats = _heartbeats(fg, "train")
        assert beats[-1] > beats[0]
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)


def _heartbeats(run: Path, role: str) -> list[float]:
    seen: list[float] = []

    def three() -> bool:
        lock = json.loads((run / "lock.json").read_text())
        assert lock["role"] == role
        if not seen or lock["heartbeat"] != seen[-1]:
            seen.append(lock["heartbeat"])
        return len(seen) >= 3

    wait_for(three, timeout=60, poll=0.2, what=f"the {role}'s heartbeat")
    return seen


def test_stop_on_a_sweeps_root_stops_every_point(work: Path, data: Path) -> None:
    """Finding 7: `hpclaunch stop` on a sweep's root used to write a file no point reads."""
    args = tiny_overrides(work, data, "sweep-stop", *SLOW)
    hpclaunch("submit", str(TINY), *args, "--sweep", "train.lr=1e-3,3e-4", cwd=work)
    root = work / "runs" / "sweep-stop"
    points = sorted(p for p in root.iterdir() if (p / "plan.json").exists() and p != root)
    assert len(points) == 2
    for point in points:
        wait_for(lambda point=point: _trained(point, 1), timeout=300, poll=0.2, what=f"{point.name} training")
    hpclaunch("stop", str(root), cwd=work)
    for point in points:
        final = wait_run_done(point, work, timeout=300)
        assert final["state"] == "stopped" and final["attempts"][-1]["cause"] == "user", point.name
    assert status(root, work)
