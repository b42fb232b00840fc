"""One real run on the local scheduler, stopped by the user, crashed by SIGKILL past its last
checkpoint, and finished, watched the whole time by `status --watch` (in a terminal) and `logs -f`;
then its time accounting in `status` and its `report` (real PNGs, looked at for being non-blank)."""

from __future__ import annotations

import json
import os
import pty
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from tests.runlib import (
    TINY,
    events,
    hpclaunch,
    rank_process,
    synth_data,
    tiny_overrides,
    wait_for,
    wait_run_done,
)

pytestmark = pytest.mark.slow

STEPS = 70
EVERY = 20  # periodic saves at 20, 40, 60
CRASH_AFTER = 46  # SIGKILL once step 46 is logged: 6+ steps past the save at 40


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "hpclaunch", *args]


def _last_step(run: Path, attempt: str | None = None) -> int:
    path = run / "metrics.jsonl"
    if not path.exists():
        return 0
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    lines = [x for x in lines if attempt is None or x.get("attempt") == attempt]
    return int(lines[-1]["step"]) if lines else 0


def _attempt_keys(run: Path) -> list[str]:
    return list(dict.fromkeys(e["attempt"] for e in events(run) if e["event"] == "started"))


def _rank0(run: Path) -> psutil.Process:
    return rank_process(run, 0)


class Terminal:
    """A command whose stdout is a pseudo-terminal (rich redraws in place only on a terminal)."""

    def __init__(self, argv: list[str], cwd: Path):
        master, slave = pty.openpty()
        env = {**os.environ, "COLUMNS": "120", "LINES": "60", "TERM": "xterm-256color"}
        env.pop("HPCLAUNCH_DEBUG", None)
        self.proc = subprocess.Popen(
            argv, cwd=cwd, stdout=slave, stderr=slave, stdin=subprocess.DEVNULL, env=env
        )
        os.close(slave)
        self.master = master
        self.chunks: list[bytes] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        while True:
            try:
                data = os.read(self.master, 65536)
            except OSError:
                return
            if not data:
                return
            self.chunks.append(data)

    def output(self) -> str:
        self.reader.join(timeout=5)
        return b"".join(self.chunks).decode(errors="replace")


@pytest.fixture(scope="module")
def story(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The run and what every watcher saw of it."""
    work = tmp_path_factory.mktemp("goodput")
    data = synth_data(work / "data")
    run = work / "runs" / "story"
    overrides = tiny_overrides(
        work,
        data,
        "story",
        f"train.steps={STEPS}",
        "train.log_every=1",
        f"checkpoint.every_steps={EVERY}",
        "testing.step_sleep_s=0.1",
        "scheduler.max_failure_retries=1",
    )
    hpclaunch("submit", str(TINY), *overrides, "--no-preflight", cwd=work)
    watch = Terminal(_cli("status", str(run), "--watch"), cwd=work)
    follow_out = open(work / "follow.txt", "wb")  # noqa: SIM115 (closed below)
    follow = subprocess.Popen(
        _cli("logs", str(run), "-f"), cwd=work, stdout=follow_out, stderr=subprocess.STDOUT
    )

    # attempt 1: a user stop that continues
    wait_for(lambda: _last_step(run) >= 8, timeout=180, poll=0.2, what="step 8")
    hpclaunch("stop", str(run), "--continue", cwd=work)
    # attempt 2: SIGKILL rank 0 (an OOM kill, a segfault) after steps past the checkpoint at 40
    wait_for(lambda: len(_attempt_keys(run)) >= 2, timeout=180, poll=0.2, what="attempt 2")
    second = _attempt_keys(run)[1]
    # a report of the run while it runs (in the background: the crash below must not wait for it)
    live = subprocess.Popen(
        _cli("report", str(run), "-o", str(work / "live-report")), cwd=work, stdout=subprocess.PIPE, text=True
    )
    saved_40 = lambda: any(  # noqa: E731
        e["event"] == "checkpoint_saved" and e.get("step") == 40 and e.get("attempt") == second
        for e in events(run)
    )
    wait_for(
        lambda: saved_40() and _last_step(run, second) >= CRASH_AFTER, timeout=180, poll=0.1, what="step 46"
    )
    _rank0(run).send_signal(signal.SIGKILL)
    killed_after = _last_step(run, second)
    live_out, _ = live.communicate(timeout=120)
    # attempt 3 resumes from 40 and finishes
    final = wait_run_done(run, work, timeout=300)
    ended_at = time.time()
    watch_code = watch.proc.wait(timeout=60)
    watch_done = time.time()
    follow_code = follow.wait(timeout=60)
    follow_out.close()
    return {
        "work": work,
        "run": run,
        "final": final,
        "killed_after": killed_after,
        "watch": (watch_code, watch.output(), watch_done - ended_at),
        "follow": (follow_code, (work / "follow.txt").read_text(errors="replace")),
        "live_report": (live.returncode, live_out),
    }


def test_the_run_went_through_a_user_stop_and_a_crash(story: dict[str, Any]) -> None:
    s = story["final"]
    assert s["state"] == "finished", json.dumps(s, indent=1)[-3000:]
    assert [(a["end"], a["cause"]) for a in s["attempts"]] == [
        ("requeued", "user"),
        ("restarted in place", "crash"),  # issue 17: the crash never went back to the scheduler
        ("finished", None),
    ]


def test_status_counts_the_crashed_attempts_lost_steps_and_their_time(story: dict[str, Any]) -> None:
    s, run, work = story["final"], story["run"], story["work"]
    spent = s["time"]
    first, crashed, last = spent["attempts"]
    # every step the SIGKILL found after the checkpoint at 40 is lost (logged with log_every=1)
    assert crashed["kept_step"] == 40 and crashed["last_step"] >= story["killed_after"] >= CRASH_AFTER
    assert crashed["lost_steps"] == crashed["last_step"] - 40
    assert crashed["lost_s"] >= 0.1 * crashed["lost_steps"]  # each step sleeps 0.1 s
    assert (
        first["lost_steps"] == 0 and last["lost_steps"] == 0 and spent["lost_steps"] == crashed["lost_steps"]
    )
    # the step figures see the same steps computed twice
    assert s["step_counts"]["repeated_steps"] == crashed["lost_steps"]
    for a in spent["attempts"]:
        phases = sum(a[f"{p}_s"] for p in ("startup", "training", "stall", "lost", "end_save", "idle"))
        assert phases == pytest.approx(a["allocated_s"], abs=0.01)
        assert a["startup_s"] > 0 and a["training_s"] > 0
    assert last["end_save_s"] > 0 and first["end_save_s"] > 0  # the stop save, the final save
    assert 0 < spent["goodput"] < 1
    assert spent["training_s"] >= 0.1 * STEPS  # every kept step slept 0.1 s
    text = hpclaunch("status", str(run), cwd=work, env={"COLUMNS": "100"}).stdout
    assert f"attempt 2 lost {crashed['lost_steps']} steps" in text
    assert "goodput" in text and "allocated became kept training" in text


def test_status_watch_redraws_in_place_and_exits_0_when_the_run_finishes(story: dict[str, Any]) -> None:
    code, out, lag = story["watch"]
    assert code == 0, out[-2000:]
    assert lag < 30  # it noticed the end within its refresh interval (+ slow machine margin)
    assert "\x1b[1A" in out or "\x1b[2K" in out  # cursor up / erase line: redrawn, not appended
    assert "state: finished" in out


def test_logs_follow_moves_through_every_attempt_and_exits_with_the_run(story: dict[str, Any]) -> None:
    code, out = story["follow"]
    assert code == 0, out[-2000:]
    keys = _attempt_keys(story["run"])
    assert f"==> attempt 2 ({keys[1]}), node 0 <==" in out
    assert f"==> attempt 3 ({keys[2]}), node 0 <==" in out
    assert out.index("==> attempt 2") < out.index("==> attempt 3") < out.rindex(f"step {STEPS}/{STEPS}")


def test_report_of_the_stopped_and_resumed_run(story: dict[str, Any]) -> None:
    import numpy as np
    from matplotlib.image import imread

    run, work = story["run"], story["work"]
    out = work / "report"
    printed = hpclaunch("report", str(run), "-o", str(out), cwd=work).stdout
    assert f"report: {out / 'index.html'}" in printed
    for name in ("timeline.png", "loss.png", "throughput.png", "ranks.png"):
        png = out / name
        assert png.stat().st_size > 15_000, name
        image = imread(png)[..., :3]
        assert image.shape[0] > 300 and image.shape[1] > 800, (name, image.shape)
        colours = np.unique((image * 255).astype(np.uint8).reshape(-1, 3), axis=0)
        assert len(colours) > 50, (name, len(colours))  # drawn, not a blank canvas
        assert float((image < 0.9).mean()) > 0.01, name  # some ink on the page
    page = (out / "index.html").read_text()
    assert page.count("data:image/png;base64,") == 4  # every rank's own work per step too
    assert "crash" in page and "user" in page and "lost steps" in page
    assert "not recorded" not in page and "no rank has recorded" not in page


def test_a_report_of_the_run_while_it_was_running(story: dict[str, Any]) -> None:
    code, printed = story["live_report"]
    out = story["work"] / "live-report"
    assert code == 0 and f"report: {out / 'index.html'}" in printed
    page = (out / "index.html").read_text()
    assert "<b>running</b>" in page and page.count("data:image/png;base64,") == 3
    assert (out / "timeline.png").stat().st_size > 10_000
