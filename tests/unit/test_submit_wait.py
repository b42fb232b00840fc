"""`submit --wait` (issue 26): in a terminal it shows the run's status while it waits; Ctrl-C ends
the waiting, not the run, and says so with the commands that would end the run."""

from __future__ import annotations

import io
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from hpclaunch.cli import run_cmd, views
from hpclaunch.rundir import RunPaths

RECORDED = Path(__file__).resolve().parent / "recorded" / "requeued_run"  # a finished local run


@pytest.fixture
def run(tmp_path: Path) -> RunPaths:
    shutil.copytree(RECORDED, tmp_path / "c1")
    return RunPaths(tmp_path / "c1")


def test_ctrl_c_ends_the_waiting_and_says_the_run_goes_on(
    run: RunPaths, monkeypatch: pytest.MonkeyPatch
) -> None:
    def interrupted(views: Any) -> bool:
        raise KeyboardInterrupt

    monkeypatch.setattr(run_cmd, "_busy", interrupted)
    err = io.StringIO()
    monkeypatch.setattr(run_cmd, "err_console", Console(file=err, width=400))
    assert run_cmd._wait(run, poll_s=0) == 130
    said = err.getvalue()
    assert "stopped waiting; the run goes on" in said
    assert f"hpclaunch stop {run.root}" in said and f"hpclaunch cancel {run.root}" in said


def test_in_a_terminal_the_status_is_shown_while_waiting(
    run: RunPaths, monkeypatch: pytest.MonkeyPatch
) -> None:
    busy = iter([True, True, False])
    monkeypatch.setattr(run_cmd, "_busy", lambda views: next(busy))
    out = io.StringIO()
    monkeypatch.setattr(run_cmd, "console", Console(file=out, force_terminal=True, width=200))
    assert run_cmd._wait(run, poll_s=0) == 0
    # Live frames while it waited, then the final status once.
    assert out.getvalue().count("state: finished") >= 2, out.getvalue()


def test_piped_it_prints_the_status_once_at_the_end(run: RunPaths, monkeypatch: pytest.MonkeyPatch) -> None:
    busy = iter([True, False])
    monkeypatch.setattr(run_cmd, "_busy", lambda views: next(busy))
    out = io.StringIO()
    monkeypatch.setattr(run_cmd, "console", Console(file=out, force_terminal=False, width=200))
    assert run_cmd._wait(run, poll_s=0) == 0
    assert out.getvalue().count("state: finished") == 1


def test_a_sweep_table_on_a_narrow_pipe_keeps_every_point_name_whole(
    run: RunPaths, monkeypatch: pytest.MonkeyPatch
) -> None:
    view = views.status_view(run)
    names = ["p0-lr1e-3-depth2-dim_text64", "p1-lr1e-3-depth2-dim_text96"]
    rows = [replace(view, run=f"/runs/sweep/{n}") for n in names]
    out = io.StringIO()
    monkeypatch.setattr(run_cmd, "console", Console(file=out, force_terminal=False, width=80))
    run_cmd._print_sweep(rows)
    first_column = "".join(
        line.split("│")[1].strip() for line in out.getvalue().splitlines() if line.startswith("│")
    )
    assert first_column == "".join(names), out.getvalue()
