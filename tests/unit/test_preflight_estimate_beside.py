"""Issue 26: preflight's estimate runs beside the checks, in the probe started before them (one torch
import for both), and no failure or interruption leaves that process behind. Fake interpreters
(no torch); the order is observed through files, never through time."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

import hpclaunch.preflight as preflight_pkg
from hpclaunch.cli import main
from hpclaunch.preflight import run_estimate as estimate_mod
from hpclaunch.preflight import runner
from hpclaunch.preflight.check_context import CheckContext, Outcome
from hpclaunch.preflight.probe import Probe
from hpclaunch.preflight.results import Status

pytestmark = pytest.mark.spawns

PROBE_ANSWER = {"python": "3.11.7", "torch": {"error": "ModuleNotFoundError: torch"}}
STEP = {"seconds_per_step": 0.5, "device": "cpu", "imports_s": 1.0, "build_s": 0.1, "steps": 3}


def fake_python(tmp_path: Path, body: str) -> Path:
    """An executable that stands for the job's Python: it ignores ``-c <probe_main>`` and runs body."""
    script = tmp_path / "fake-python"
    script.write_text(
        f"#!{sys.executable}\nimport json, os, sys, time\nfrom pathlib import Path\n"
        f"D = Path({str(tmp_path)!r})\n"
        "(D / 'pid').write_text(str(os.getpid()))\n"
        "request = json.loads(sys.stdin.read())\n"
        "(D / 'request.json').write_text(json.dumps(request))\n"
        f"print(json.dumps({PROBE_ANSWER!r}), flush=True)\n"
        "if 'estimate' not in request:\n    sys.exit(0)  # a probe that was not asked for steps\n" + body
    )
    script.chmod(0o755)
    return script


def wait_for(path: Path, within_s: float = 30.0) -> bool:
    end = time.monotonic() + within_s
    while not path.exists():
        if time.monotonic() > end:
            return False
        time.sleep(0.02)
    return True


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def config(tmp_path: Path, python: Path) -> list[str]:
    (tmp_path / "run.yaml").write_text("name: t\ntrain: {steps: 20, global_batch: 8}\n")
    return [
        "preflight",
        str(tmp_path / "run.yaml"),
        "--set",
        f"launch.python={python}",
        "--set",
        f"run_dir={tmp_path / 'runs' / 't'}",
    ]


def test_the_steps_are_timed_while_the_checks_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The fake times its "steps" only once a check has seen them begin: had the estimate waited for
    # the checks (as it did), the check below would never see the marker and the steps never end.
    python = fake_python(
        tmp_path,
        "(D / 'steps-started').write_text('')\n"
        "end = time.monotonic() + 30\n"
        "while not (D / 'check-saw-steps').exists() and time.monotonic() < end:\n"
        "    time.sleep(0.02)\n"
        f"print(json.dumps({{'step_estimate': {STEP!r}}}), flush=True)\n",
    )
    seen: list[bool] = []

    def check_fds(_: CheckContext) -> Outcome:
        seen.append(wait_for(tmp_path / "steps-started"))
        (tmp_path / "check-saw-steps").write_text("")
        return Outcome(Status.PASS, "saw the steps begin" if seen[-1] else "the steps had not begun")

    monkeypatch.setitem(runner.CHECKS, "fds", runner.Check("fds", check_fds, 60))
    code = main([*config(tmp_path, python), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 1  # env fails: the fake has no torch; the estimate still comes
    assert seen == [True]
    assert {c["name"]: c["finding"] for c in out["checks"]}["fds"] == "saw the steps begin"
    request = json.loads((tmp_path / "request.json").read_text())
    assert request["estimate"]["steps"] == estimate_mod.STEPS and request["model"] is not None
    assert out["estimate"]["state"] == "estimated" and out["estimate"]["seconds_per_step"] == 0.5
    assert gone(int((tmp_path / "pid").read_text()))


def test_a_failing_check_and_a_hung_estimate_leave_no_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    python = fake_python(tmp_path, "time.sleep(600)\n")  # answers, then never times its steps
    monkeypatch.setattr(estimate_mod, "TIMEOUT_S", 3.0)
    code = main(config(tmp_path, python))
    captured = capsys.readouterr()
    assert code == 1 and "check(s) failed" in captured.err
    assert "estimate: cannot measure a step here: the measured steps took longer than 3 s" in captured.out
    assert gone(int((tmp_path / "pid").read_text()))


def test_an_interrupted_preflight_kills_the_estimate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    python = fake_python(tmp_path, "time.sleep(600)\n")

    def interrupted(*_: object, **__: object) -> None:
        assert wait_for(tmp_path / "request.json")  # the probe runs, and has its request
        raise KeyboardInterrupt

    monkeypatch.setattr(preflight_pkg, "run_login_checks", interrupted)
    with pytest.raises((KeyboardInterrupt, SystemExit)):
        code = main(config(tmp_path, python))
        raise SystemExit(code)
    assert gone(int((tmp_path / "pid").read_text()))


def test_no_estimate_and_only_start_no_estimate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    python = fake_python(tmp_path, "")
    main([*config(tmp_path, python), "--no-estimate", "--json"])
    assert "estimate" not in json.loads((tmp_path / "request.json").read_text())


def test_probe_answers_before_its_steps_and_reads_them_after(tmp_path: Path) -> None:
    python = fake_python(
        tmp_path,
        "while not (D / 'go').exists():\n    time.sleep(0.02)\n"
        f"print(json.dumps({{'step_estimate': {STEP!r}}}), flush=True)\n",
    )
    probe = Probe(str(python), model=None, timeout_s=30, estimate={"steps": 3})
    try:
        assert probe.result() == PROBE_ANSWER  # while the fake still waits for 'go'
        assert probe._proc is not None and probe._proc.poll() is None
        (tmp_path / "go").write_text("")
        assert probe.step_estimate(30) == STEP
    finally:
        probe.close()


def test_steps_that_crash_say_why(tmp_path: Path) -> None:
    python = fake_python(tmp_path, "sys.stderr.write('Segmentation fault\\n'); sys.exit(139)\n")
    probe = Probe(str(python), model=None, timeout_s=30, estimate={"steps": 3})
    try:
        assert probe.result() == PROBE_ANSWER
        assert probe.step_estimate(30) == {"error": "Segmentation fault"}
    finally:
        probe.close()
