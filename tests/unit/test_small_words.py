"""The small things a new user trips on (issue 39, 11): piped output whole, the words of status,
the help every command gives, a unit-less time limit."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from hpclaunch.cli import main
from hpclaunch.config import load_config
from hpclaunch.errors import ConfigError

pytestmark = pytest.mark.fast

RECORDED = Path(__file__).resolve().parent / "recorded" / "requeued_run"  # a finished local run


@pytest.fixture(autouse=True)
def _quiet(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv("HPCLAUNCH_DEBUG", raising=False)
    yield


def test_piped_status_keeps_each_line_whole_and_says_what_the_queue_wait_is(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from hpclaunch.cli import common, run_cmd

    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.setattr(run_cmd, "console", common.stdout_console())  # as the CLI makes it, piped
    run = tmp_path / ("a-run-directory-with-a-long-name-" * 2 + "x")
    shutil.copytree(RECORDED, run)
    assert main(["status", str(run)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"{run}  state: finished  job: local9687 (unknown)", lines[
        :3
    ]  # one line, > 80 columns
    said = next(line for line in lines if line.startswith("goodput "))
    assert said.endswith("s waiting in the queue, not counted as allocated"), said
    assert main(["status", str(run), "--watch"]) == 0  # piped: the final status once, ended by a newline
    assert capsys.readouterr().out.endswith("\n")


def test_a_time_limit_without_a_unit_gets_the_unit_it_probably_meant() -> None:
    with pytest.raises(ConfigError) as e:
        load_config(None, ["scheduler.time_limit=90"])
    assert "scheduler.time_limit: 90 has no unit" in e.value.one_line()
    assert "(did you mean '90m', 01:30:00?)" in e.value.one_line()


@pytest.mark.parametrize("command", [["train"], ["status"], ["config", "schema"], []])
def test_dash_h_is_help(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*command, "-h"]) == 0
    assert "Usage: hpclaunch" in capsys.readouterr().out


def test_train_help_lists_its_exit_codes_and_schema_names_where_its_table_lives(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["train", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for said in ("3 ended by the user", "4 stopped at the time limit", "5 preempted"):
        assert said in text, text
    assert main(["config", "schema", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.replace("│", " ").split())
    assert "docs/configuration.md" in text and "README" not in text


@pytest.mark.parametrize(
    ("argv", "first"),
    [
        (["status"], "hpclaunch: error: status: Missing argument 'RUN'"),
        (["status", "--bogus", "x"], "hpclaunch: error: status: No such option: --bogus"),
        (["bogus"], "hpclaunch: error: No such command 'bogus'"),
    ],
)
def test_a_command_line_error_is_one_line_and_a_hint_exit_2(
    argv: list[str], first: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """As every other error: it was click's boxed usage text, three to five lines."""
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert (
        lines[0].startswith(first) and len(lines) == 2 and lines[1].strip().startswith("hint: hpclaunch")
    ), lines


def test_a_filesystem_refusal_is_one_line_only_where_it_names_a_file() -> None:
    """A read-only or full place to write: bad input (2) or a fault (1), said in one line; an error
    that names no file (a signal to another user's process) is no place to write: its traceback."""
    import errno

    from hpclaunch.cli import filesystem_refusal

    ro = filesystem_refusal(OSError(errno.EROFS, "Read-only file system", "/mnt/ro/run"))
    full = filesystem_refusal(OSError(errno.ENOSPC, "No space left on device", "/scratch/run"))
    assert (
        ro is not None
        and ro.exit_code == 2
        and ro.one_line() == "/mnt/ro/run: cannot write here: Read-only file system"
    )
    assert full is not None and full.exit_code == 1
    assert filesystem_refusal(PermissionError(errno.EPERM, "Operation not permitted")) is None
    assert filesystem_refusal(OSError(errno.EIO, "Input/output error", "/x")) is None
