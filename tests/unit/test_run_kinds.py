"""Commands that take a run directory say what they found there when they cannot apply to it, and a
``--resume`` never changes what a directory holds (a run, a sweep's root, a sweep's point): one
line, exit 2, nothing written (issue 39). Also: the exit codes of the waits, and `logs` of every
attempt."""

from __future__ import annotations

import io
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from rich.console import Console

from hpclaunch.cli import main, run_cmd
from hpclaunch.rundir import RunPaths
from hpclaunch.rundir.readers import RunKind, what_is_at

pytestmark = pytest.mark.fast

RECORDED = Path(__file__).resolve().parent / "recorded" / "requeued_run"  # a finished local run
TINY = Path(__file__).resolve().parents[2] / "examples" / "tiny.yaml"
STOP_AT = 1795545669.967  # the recorded run's first stop (step 54)


@pytest.fixture(autouse=True)
def _quiet(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv("HPCLAUNCH_DEBUG", raising=False)
    yield


def _events(run: Path) -> list[dict[str, object]]:
    return [
        json.loads(line)
        for f in sorted((run / "events").glob("*.jsonl"))
        for line in f.read_text().splitlines()
    ]


def stopped_run(where: Path) -> Path:
    """The recorded run as it was when the user stopped it at step 54 (the later attempts cut off)."""
    shutil.copytree(RECORDED, where)
    kept = [e for e in _events(where) if float(e["ts"]) <= STOP_AT]  # type: ignore[arg-type]
    for e in kept:
        if e["event"] == "stopped":
            e["cause"] = "user"
    kept.append({"ts": STOP_AT + 0.5, "event": "ended", "attempt": "local9687.0", "cause": "user"})
    metrics = (where / "metrics.jsonl").read_text().splitlines()
    (where / "metrics.jsonl").write_text("".join(m + "\n" for m in metrics if json.loads(m)["step"] <= 54))
    shutil.rmtree(where / "events")
    (where / "events").mkdir()
    (where / "events" / "all.jsonl").write_text("".join(json.dumps(e) + "\n" for e in kept))
    return where


def sweep(where: Path) -> Path:
    """A sweep's root (the recorded run's plan and config) with two stopped points."""
    where.mkdir(parents=True)
    for name in ("config.yaml", "plan.json"):
        shutil.copy(RECORDED / name, where / name)
    (where / "events").mkdir()
    points = [stopped_run(where / name) for name in ("p0-lr0.0001", "p1-lr0.0003")]
    (where / "sweep.json").write_text(
        json.dumps({"job_id": "a,b", "points": [{"run_dir": str(p)} for p in points]})
    )
    return where


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) <= 2 and lines[0].startswith("hpclaunch: error: "), err
    return " ".join(lines)


def test_what_is_at_tells_a_run_a_sweep_a_point_and_nothing_apart(tmp_path: Path) -> None:
    root = sweep(tmp_path / "sw")
    assert what_is_at(root).kind is RunKind.SWEEP and len(what_is_at(root).points) == 2
    point = what_is_at(root / "p0-lr0.0001")
    assert point.kind is RunKind.POINT and point.sweep == root.resolve()
    assert what_is_at(stopped_run(tmp_path / "r")).kind is RunKind.RUN
    assert what_is_at(tmp_path / "nope").describe().endswith("does not exist")
    (tmp_path / "empty").mkdir()
    assert "not an hpclaunch run directory" in what_is_at(tmp_path / "empty").describe()


def test_resume_with_a_sweep_never_turns_a_run_into_a_sweep(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = stopped_run(tmp_path / "d1")
    before = snapshot(run)
    code = main(["submit", "--resume", str(run), "--sweep", "train.lr=1e-4,3e-4", "--no-preflight"])
    assert code == 2
    line = one_line(capsys.readouterr().err)
    assert "--sweep: " in line and "a resume never turns a run into a sweep; nothing was written" in line
    assert snapshot(run) == before and not (run / "sweep.json").exists()


def test_resume_of_a_sweep_root_is_refused_naming_its_points(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = sweep(tmp_path / "sw")
    before = snapshot(root)
    assert main(["submit", "--resume", str(root), "--set", "train.steps=300", "--no-preflight"]) == 2
    line = one_line(capsys.readouterr().err)
    assert "is a sweep of 2 points (p0-lr0.0001, p1-lr0.0003), not one run" in line, line
    assert f"hpclaunch submit --resume {root.resolve() / 'p0-lr0.0001'}" in line
    assert snapshot(root) == before


def test_sample_of_a_sweep_root_names_a_point_instead(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = sweep(tmp_path / "sw")
    assert main(["sample", str(root), "--n", "1"]) == 2
    line = one_line(capsys.readouterr().err)
    assert "is a sweep of 2 points" in line and "sample takes one run" in line
    assert f"hpclaunch sample {root.resolve() / 'p0-lr0.0001'}" in line


def test_train_into_a_sweep_root_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = sweep(tmp_path / "sw")
    before = snapshot(root)
    assert main(["train", str(TINY), "--set", f"run_dir={root}", "--resume"]) == 2
    line = one_line(capsys.readouterr().err)
    assert "is a sweep of 2 points" in line and "training here would make its root a run" in line
    assert snapshot(root) == before


@pytest.mark.parametrize("command", ["cancel", "stop"])
def test_cancel_and_stop_of_an_ended_run_say_so_alike(
    tmp_path: Path, command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    run = stopped_run(tmp_path / "r")
    before = snapshot(run)
    assert main([command, str(run)]) == 2
    line = one_line(capsys.readouterr().err)
    assert f"nothing to {command}: the run has ended (stopped); nothing was written" in line, line
    assert snapshot(run) == before


def test_cancel_of_a_sweep_whose_points_have_ended(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = sweep(tmp_path / "sw")
    before = snapshot(root)
    assert main(["cancel", str(root)]) == 2
    assert "nothing to cancel: every point of the sweep has ended (stopped)" in capsys.readouterr().err
    assert snapshot(root) == before


def test_a_run_directory_given_as_config_gets_a_hint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = stopped_run(tmp_path / "fg")
    assert main(["submit", str(run), "--no-preflight"]) == 2
    line = one_line(capsys.readouterr().err)
    assert f"{run}: a run directory, not a CONFIG file" in line
    assert f"hpclaunch submit --resume {run}" in line and f"hpclaunch train {run} --resume" in line


def test_train_resume_takes_the_run_directory_for_its_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = stopped_run(tmp_path / "fg")
    # The run's own config names data this machine does not have: the refusal shows it was read.
    assert main(["train", str(run), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "Is a directory" not in err and "data" in err, err


def test_the_waits_exit_0_for_a_stopped_run_and_say_how_it_ended(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = stopped_run(tmp_path / "r")
    out = io.StringIO()
    monkeypatch.setattr(run_cmd, "console", Console(file=out, force_terminal=False, width=300))
    assert run_cmd._wait(RunPaths(run), poll_s=0) == 0  # submit --wait and status --watch alike
    said = out.getvalue()
    assert "state: stopped" in said
    assert (
        f"{run} stopped at step 54 (user), not finished; continue it: hpclaunch submit --resume {run}" in said
    )


def test_logs_prints_every_attempt_headed_by_how_it_ended(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "r"
    shutil.copytree(RECORDED, run)
    for i, attempt in enumerate(("local9687.0", "local9687.1", "local9687.2")):
        log = RunPaths(run).node_log(attempt, 0)
        log.parent.mkdir(parents=True)
        log.write_text(f"the log of attempt {i + 1}\n")
    assert main(["logs", str(run)]) == 0
    out = capsys.readouterr().out
    assert "==> attempt 1 of 3 (local9687.0), node 0: requeued after step 54 (timeout) <==" in out, out
    assert "==> attempt 3 of 3 (local9687.2), node 0: finished after step 120 <==" in out
    assert (
        out.index("the log of attempt 1")
        < out.index("the log of attempt 2")
        < out.index("the log of attempt 3")
    )
    assert main(["logs", str(run), "--attempt", "2"]) == 0
    out = capsys.readouterr().out
    assert "the log of attempt 2" in out and "attempt 1" not in out
