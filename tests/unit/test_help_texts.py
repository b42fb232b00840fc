"""Every command's and every group's --help has examples (README promises it), commands that can end
in several ways list their exit codes, and --only lists every login check (issue 46, item 8)."""

from __future__ import annotations

from typing import Any

import pytest

from hpclaunch.cli import command, main
from hpclaunch.cli.preflight_cmd import ONLY_HELP
from hpclaunch.preflight.runner import LOGIN_CHECKS

pytestmark = pytest.mark.fast


def _paths(command: Any, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    out = [prefix] if prefix else []
    if hasattr(command, "commands"):  # a group (typer's own click, or click)
        for name, sub in command.commands.items():
            out += _paths(sub, (*prefix, name))
    return out


COMMANDS = _paths(command())


def test_the_walk_finds_the_groups_and_their_commands() -> None:
    assert {("config",), ("config", "show"), ("data", "synth"), ("nccl", "presets"), ("submit",)} <= set(
        COMMANDS
    )


@pytest.mark.parametrize("path", COMMANDS, ids=" ".join)
def test_every_command_and_group_has_examples(
    path: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*path, "--help"]) == 0
    assert "Example" in capsys.readouterr().out, f"hpclaunch {' '.join(path)} --help has no example"


@pytest.mark.parametrize("command", ["submit", "train", "preflight"])
def test_commands_that_end_in_several_ways_list_their_exit_codes(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([command, "--help"]) == 0
    assert "Exit code" in capsys.readouterr().out


def test_only_names_every_login_check() -> None:
    listed = ONLY_HELP.split(": ", 1)[1].rstrip(".").split(", ")
    assert listed == list(LOGIN_CHECKS)
