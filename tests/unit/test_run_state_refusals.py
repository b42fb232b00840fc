"""Commands that cannot apply to a run's state are refused in one line, exit 2, nothing written or
submitted (issue 26): `stop` of a run that has ended, `submit --resume` of a finished run, and
`submit CONFIG --resume RUN` (whose CONFIG would have been ignored)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from hpclaunch.cli import main
from hpclaunch.rundir import RunPaths

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
