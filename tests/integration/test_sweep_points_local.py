"""A sweep on the embedded local scheduler, for real: ``scheduler.array_parallelism`` is kept (a point
waits for its slot and says so), and a sweep resumed point by point continues each point from its
own checkpoint, in its own run directory, still a point of its sweep."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tests.runlib import TINY, events, hpclaunch, status, synth_data, tiny_overrides, wait_for

pytestmark = pytest.mark.slow

BUSY = (
    "scheduler.procs_per_node=1",
    "scheduler.array_parallelism=1",
    "train.warmup_steps=2",
    "train.steps=2000",  # stopped long before the end
    "train.log_every=1",
    "testing.step_sleep_s=0.05",
    "checkpoint.every_steps=1000",
)


def _logged_step(run: Path) -> int:
    try:
        lines = (run / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return 0
    return max((json.loads(line)["step"] for line in lines if line.strip()), default=0)


def _stopped_step(run: Path, work: Path) -> int:
    def ended() -> dict[str, object] | None:
        s = status(run, work)
        return s if s["state"] == "stopped" else None

    wait_for(ended, timeout=240, poll=0.5, what=f"{run.name} to stop")
    return int(next(e for e in events(run) if e["event"] == "stopped")["step"])


def test_points_take_turns_and_each_resumes_from_its_own_checkpoint(tmp_path: Path) -> None:
    data = synth_data(tmp_path / "data", samples=128)
    root = tmp_path / "runs" / "sw"
    overrides = tiny_overrides(tmp_path, data, "sw", *BUSY)
    hpclaunch(
        "submit", str(TINY), *overrides, "--sweep", "train.lr=1e-3,2e-3", "--no-preflight", cwd=tmp_path
    )
    try:
        p0, p1 = (Path(p["run_dir"]) for p in json.loads((root / "sweep.json").read_text())["points"])

        wait_for(lambda: _logged_step(p0) >= 3, timeout=240, poll=0.2, what="p0's step 3")
        second = status(p1, tmp_path)
        assert second["state"] == "pending", second["state"]
        assert "waiting for a slot: scheduler.array_parallelism is 1" in second["scheduler"]["reason"]
        assert not [e for e in events(p1) if e["event"] == "started"]

        hpclaunch("stop", str(p0), cwd=tmp_path)
        s0 = _stopped_step(p0, tmp_path)
        wait_for(lambda: _logged_step(p1) >= 3, timeout=240, poll=0.2, what="p1's step 3")
        ended0 = max(e["ts"] for e in events(p0))
        started1 = min(e["ts"] for e in events(p1) if e["event"] == "started")
        assert started1 > ended0  # one at a time: p1 started once p0's job had ended
        hpclaunch("stop", str(root), cwd=tmp_path)  # the sweep's root: every point still running
        s1 = _stopped_step(p1, tmp_path)

        for point, step in ((p0, s0), (p1, s1)):
            done = hpclaunch(
                "submit", "--resume", str(point), "--set", f"train.steps={step + 2}", "--no-preflight", "--wait",
                cwd=tmp_path, check=False,
            )  # fmt: skip
            assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
            resumed = [e["step"] for e in events(point) if e["event"] == "resumed"]
            assert resumed == [0, step], (point.name, resumed)  # from its own stop's checkpoint
    finally:  # nothing left running when an assertion failed half-way
        hpclaunch("cancel", str(root), cwd=tmp_path, check=False)
    sweep = json.loads(hpclaunch("status", str(root), "--json", cwd=tmp_path).stdout)
    assert [p["state"] for p in sweep["points"]] == ["finished", "finished"]
    assert [p["step"] for p in sweep["points"]] == [s0 + 2, s1 + 2]
