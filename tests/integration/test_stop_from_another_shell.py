"""A run stopped from another shell, for real: a foreground ``hpclaunch train`` (no controller: its
own process is the job) and a submitted local run, each stopped with ``hpclaunch stop`` while it
trains, then resumed. What ``status`` calls ended can be resumed at once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tests.runlib import TINY, events, hpclaunch, status, synth_data, tiny_overrides, wait_for

pytestmark = pytest.mark.slow

BUSY = (
    "scheduler.procs_per_node=1",
    "train.warmup_steps=2",
    "train.steps=2000",  # far more than the test waits for: it is stopped long before the end
    "train.log_every=1",
    "testing.step_sleep_s=0.05",
    "checkpoint.every_steps=1000",
    "preflight.distributed_smoke=false",
)


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("stop-elsewhere")


@pytest.fixture(scope="module")
def data(work: Path) -> Path:
    return synth_data(work / "data", samples=128)


def _logged_step(run: Path) -> int:
    try:
        lines = (run / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return 0
    return max((json.loads(line)["step"] for line in lines if line.strip()), default=0)


def test_a_foreground_train_shows_running_and_stops_at_one_step_from_another_shell(
    work: Path, data: Path
) -> None:
    run = work / "runs" / "fg"
    args = ["train", str(TINY), *tiny_overrides(work, data, "fg", *BUSY)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("HPCLAUNCH_DEBUG", None)
    train = subprocess.Popen(
        [sys.executable, "-m", "hpclaunch", *args],
        cwd=work,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_for(lambda: _logged_step(run) >= 3, timeout=240, poll=0.2, what="the foreground run's step 3")
        seen = status(run, work)
        assert seen["state"] == "running", seen["state"]
        assert seen["scheduler"]["state"] == "running", seen["scheduler"]
        assert seen["hint"] is None

        stopped = hpclaunch("stop", str(run), cwd=work, check=False)
        assert stopped.returncode == 0, stopped.stderr
        out, _ = train.communicate(timeout=240)
    finally:
        if train.poll() is None:
            train.kill()
    assert train.returncode == 3, out[-3000:]
    assert out.count("stopped at step ") == 1, out[-3000:]  # the last word, said once
    assert "UserWarning" not in out, out[-3000:]
    stop = next(e for e in events(run) if e["event"] == "stopped")
    assert stop["cause"] == "user"
    assert (run / "checkpoints" / f"step_{stop['step']:06d}").is_dir()  # the stop's own checkpoint
    after = status(run, work)
    assert after["state"] == "stopped" and after["step"] == stop["step"]
    assert after["eta_s"] is None  # a stopped run is going nowhere
    # What the attempt did and why it ended, from the run's own log.
    log = hpclaunch("logs", str(run), cwd=work).stdout
    assert (
        f"==> attempt 1 of 1 (fg{train.pid}.0), node 0: stopped after step {stop['step']} (user) <==" in log
    )
    assert f"# hpclaunch: end: stopped by the user after step {stop['step']}" in log, log[-2000:]
    assert "UserWarning" not in log  # DCP's "assuming a single process" on one rank

    # The run directory stands for its config (as `submit --resume RUN` takes it).
    resumed = hpclaunch(
        "train", str(run), "--resume", "--set", f"train.steps={stop['step'] + 2}", cwd=work, check=False
    )
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    steps = [e["step"] for e in events(run) if e["event"] == "resumed"]
    assert steps[-1] == stop["step"]
    # Training it shorter (2000 -> stop + 2 steps) keeps the LR schedule's 2000 steps (issue 46,
    # docs/runs.md): the first resumed step trains at the LR the run would have had, and it says so.
    from hpclaunch.config import load_config
    from hpclaunch.lr_schedule import lr_at

    first = stop["step"] + 1
    said = f"resume: train.steps 2000 -> {stop['step'] + 2} from step {first}; the LR schedule keeps its 2000"
    assert said in resumed.stderr, resumed.stderr[-3000:]
    assert said in "\n".join(status(run, work)["schedule_changes"])
    started_with = load_config(TINY, [o for o in tiny_overrides(work, data, "fg", *BUSY) if o != "--set"])
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    lr = [m["lr"] for m in logged if m["step"] == first][-1]
    assert lr == pytest.approx(lr_at(first, started_with.train), rel=1e-6)


def test_a_submitted_run_is_resumable_as_soon_as_status_calls_it_stopped(work: Path, data: Path) -> None:
    run = work / "runs" / "sub"
    hpclaunch("submit", str(TINY), *tiny_overrides(work, data, "sub", *BUSY), "--no-preflight", cwd=work)
    try:
        wait_for(lambda: _logged_step(run) >= 2, timeout=240, poll=0.2, what="the submitted run's step 2")
        hpclaunch("stop", str(run), cwd=work)
        seen = []

        def ended() -> bool:
            seen.append(status(run, work)["state"])
            return seen[-1] not in ("running", "stopping")

        wait_for(ended, timeout=240, poll=0.2, what="the run to stop")
        assert seen[-1] == "stopped", seen
        # At once: status called it stopped, so nothing of the job may still hold the run.
        again = hpclaunch(
            "submit",
            "--resume",
            str(run),
            "--set",
            "train.steps=4000",
            "--no-preflight",
            cwd=work,
            check=False,
        )
        assert again.returncode == 0, again.stderr
        # Training it further says what becomes of the LR schedule, at submit and in status.
        said = "resume: train.steps 2000 -> 4000 from step "
        assert said in again.stdout and "the LR schedule keeps its 2000 steps" in again.stdout, again.stdout
        assert any(said in line for line in status(run, work)["schedule_changes"])
    finally:  # the resumed run, or one an assertion left running
        hpclaunch("cancel", str(run), cwd=work, check=False)


def test_a_foreground_train_cancelled_from_another_shell_says_so(work: Path, data: Path) -> None:
    run = work / "runs" / "fgcancel"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("HPCLAUNCH_DEBUG", None)
    train = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "hpclaunch",
            "train",
            str(TINY),
            *tiny_overrides(work, data, "fgcancel", *BUSY),
        ],
        cwd=work,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_for(lambda: _logged_step(run) >= 2, timeout=240, poll=0.2, what="the foreground run's step 2")
        cancelled = hpclaunch("cancel", str(run), cwd=work, check=False)
        assert cancelled.returncode == 0, cancelled.stderr
        out, _ = train.communicate(timeout=240)
    finally:
        if train.poll() is None:
            train.kill()
    assert train.returncode == 3, out[-3000:]  # ended by the user, not "preempted" (5)
    assert "cancelled at step " in out and "(cancelled)" in out, out[-2000:]
    assert status(run, work)["state"] == "cancelled"
