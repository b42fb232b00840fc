"""Commands that cannot apply to a run's state are refused in one line, exit 2, nothing written or
submitted (issue 26): `stop` of a run that has ended, `submit --resume` of a finished run, and
`submit CONFIG --resume RUN` (whose CONFIG would have been ignored)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from hpclaunch.cli import main
from hpclaunch.rundir import RunPaths

pytestmark = pytest.mark.fast

RECORDED = Path(__file__).resolve().parent / "recorded" / "requeued_run"  # a finished local run
TINY = Path(__file__).resolve().parents[2] / "examples" / "tiny.yaml"


@pytest.fixture(autouse=True)
def _quiet(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv("HPCLAUNCH_DEBUG", raising=False)
    yield


@pytest.fixture
def finished(tmp_path: Path) -> Path:
    run = tmp_path / "c1"
    shutil.copytree(RECORDED, run)
    return run


def snapshot(run: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


def one_line(err: str) -> str:
    """The error's line (a hint may follow on its own line, as every error's)."""
    lines = err.strip().splitlines()
    assert len(lines) <= 2 and lines[0].startswith("hpclaunch: error: "), err
    assert all(line.lstrip().startswith("hint: ") for line in lines[1:]), err
    return err


def test_stop_of_a_finished_run_says_so_and_writes_nothing(
    finished: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = snapshot(finished)
    assert main(["stop", str(finished)]) == 2
    line = one_line(capsys.readouterr().err)
    assert "nothing to stop: the run has ended (finished); nothing was written" in line, line
    assert snapshot(finished) == before and not RunPaths(finished).stop_file.exists()


def test_resume_of_a_finished_run_is_refused_and_submits_nothing(
    finished: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = snapshot(finished)
    assert main(["submit", "--resume", str(finished), "--no-preflight"]) == 2
    line = one_line(capsys.readouterr().err)
    assert "--resume: " in line and "has finished (step 120/120): there is nothing to resume" in line, line
    assert "--set train.steps=N" in line
    assert snapshot(finished) == before
    # a shorter length than the run reached: said as such, not "finished (step 120/50)"
    assert main(["submit", "--resume", str(finished), "--no-preflight", "--set", "train.steps=50"]) == 2
    line = one_line(capsys.readouterr().err)
    assert "is at step 120, past train.steps=50: there is nothing to resume" in line, line
    assert snapshot(finished) == before


def test_submit_with_a_config_and_resume_is_refused_not_silently_ignoring_the_config(
    finished: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = snapshot(finished)
    assert main(["submit", str(TINY), "--resume", str(finished), "--no-preflight"]) == 2
    line = one_line(capsys.readouterr().err)
    assert (
        f"--resume continues {finished} with the config it was started with; {TINY} would be ignored" in line
    )
    assert snapshot(finished) == before


# ---- issue 46, item 9: the seconds after a cancel, and a stop that arrives as the run ends --------


def _cancelled_while_running(run: Path) -> None:
    """The recorded run with its last attempt not yet ended (no save, no decision) and a
    `hpclaunch cancel` recorded while it ran: what status reads until the killed agent says more."""
    import json

    for log in (run / "events").glob("*.jsonl"):
        keep = [
            line
            for line in log.read_text().splitlines()
            if not (
                json.loads(line).get("attempt") == "local9687.2"
                and json.loads(line)["event"] in ("checkpoint_saved", "finished")
            )
        ]
        log.write_text("".join(f"{line}\n" for line in keep))
    cancel = {"ts": 1795545693.0, "seq": 1, "event": "cancelled", "writer": "cli", "job_id": "local9687"}
    (run / "events" / "cli-vm-1.jsonl").write_text(json.dumps(cancel) + "\n")


def test_a_cancelled_runs_attempt_reads_cancelling_and_its_lost_steps_wait_for_a_resume(
    finished: Path,
) -> None:
    from hpclaunch.cli.time_view import time_parts
    from hpclaunch.orchestrator.status import summarize

    _cancelled_while_running(finished)
    view = summarize(finished, scheduler_status=None)
    assert view.state == "cancelled"
    assert view.attempts[-1].end == "cancelling"  # not "running"
    lines = [str(part) for part in time_parts(view)]
    lost = next(line for line in lines if line.startswith("attempt 3 lost"))
    assert "lost 13 steps" in lost and "are computed again" not in lost
    assert lost.endswith("a resume would compute them again (the run is cancelled)"), lost


class _View:
    def __init__(self, state: str, in_flight: bool = True) -> None:
        self.state, self.in_flight = state, in_flight
        # (stopping: for the user's own stop; one for the scheduler's is continued, and a stop is
        # taken then: test_stop_while_stopping.py)
        self.attempts = [SimpleNamespace(cause="user")]


@pytest.mark.parametrize("state", ["finishing", "failing", "cancelling", "stopping"])
def test_stop_of_a_run_that_is_ending_is_refused_and_leaves_nothing(
    finished: Path, state: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from hpclaunch.cli import stop_cmd

    monkeypatch.setattr(stop_cmd, "status_view", lambda paths: _View(state))
    before = snapshot(finished)
    assert main(["stop", "--continue", str(finished)]) == 2
    assert f"nothing to stop: the run has ended ({state})" in one_line(capsys.readouterr().err)
    assert snapshot(finished) == before


def test_a_stop_that_lands_as_the_run_ends_is_taken_back_and_said_so(
    finished: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`stop --continue` 16 ms after the run finished said "stop requested", exit 0, and left
    control/stop behind: the run ended between the look and the request landing."""
    from hpclaunch.cli import stop_cmd

    seen = iter([_View("running"), _View("finished", in_flight=False)])
    monkeypatch.setattr(stop_cmd, "status_view", lambda paths: next(seen))
    before = snapshot(finished)
    assert main(["stop", "--continue", str(finished)]) == 2
    line = one_line(capsys.readouterr().err)
    assert "nothing to stop: the run ended (finished) before the stop reached it" in line
    assert not RunPaths(finished).stop_file.exists() and snapshot(finished) == before
