"""Small CLI findings of issue 26: `--version`, `init` into a folder that does not exist, and the
word "torchrun" where the rank host replaced it."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpclaunch import __version__
from hpclaunch.cli import main


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"hpclaunch {__version__}"


def test_init_into_a_missing_folder_creates_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "nonexistent" / "dir" / "x.yaml"
    assert main(["init", str(target)]) == 2
    err = capsys.readouterr().err
    assert "does not exist; nothing was written" in err and "mkdir -p" in err
    assert not (tmp_path / "nonexistent").exists()
    assert main(["init", str(tmp_path / "x.yaml")]) == 0 and (tmp_path / "x.yaml").is_file()


def test_init_shows_the_memory_tiers_keys_under_their_own_header(tmp_path: Path) -> None:
    """Uncommenting the memory tier's ``every_steps`` in what init wrote set the disk's interval to 5
    and left the tier off: its keys were shown under ``checkpoint:`` with no ``memory:`` header."""
    from hpclaunch.config import load_config

    target = tmp_path / "x.yaml"
    assert main(["init", str(target)]) == 0
    text = target.read_text()
    assert "\n  memory:\n" in text and "\n    every_steps: null\n" in text
    target.write_text(text.replace("\n    every_steps: null\n", "\n    every_steps: 5\n"))
    cfg = load_config(target)
    assert cfg.checkpoint.memory.every_steps == 5 and cfg.checkpoint.every_steps == 50


@pytest.mark.parametrize("command", ["train", "logs", "preflight"])
def test_help_does_not_name_torchrun_where_the_rank_host_replaced_it(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([command, "--help"]) == 0
    assert "torchrun" not in capsys.readouterr().out


def test_logs_of_a_sweep_names_its_points(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 26: `logs runs/SWEEP` said "no logs yet (the job has not started)" for a finished sweep."""
    import json

    root = tmp_path / "sweep"
    (root / "events").mkdir(parents=True)
    points = [str(root / "p0-lr1e-3"), str(root / "p1-lr5e-4")]
    (root / "sweep.json").write_text(json.dumps({"points": [{"run_dir": p} for p in points]}))
    assert main(["logs", str(root)]) == 2
    err = capsys.readouterr().err
    assert "is a sweep of 2 points (p0-lr1e-3, p1-lr5e-4), not one run: logs takes one run" in err
    assert f"hpclaunch logs {points[0]}" in err and "has not started" not in err


@pytest.mark.parametrize("command", ["render", "report", "sample"])
def test_every_command_that_writes_files_takes_o_out_and_output(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 26: `render -o/--output` but `report -o/--out`: one spelling set for all."""
    assert main([command, "--help"]) == 0
    text = capsys.readouterr().out
    assert "--out" in text and "--output" in text and "-o" in text


def test_config_show_is_block_yaml_without_the_default_test_knobs(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 26: `config show` mixed block and flow YAML and printed an undocumented `testing:`."""
    import yaml

    tiny = str(Path(__file__).resolve().parents[2] / "examples" / "tiny.yaml")
    assert main(["config", "show", tiny]) == 0
    text = capsys.readouterr().out
    shown = yaml.safe_load(text)
    assert "testing" not in shown and shown["model"]["depth"] == 2
    assert not [line for line in text.splitlines() if line.rstrip().endswith("}") and "{}" not in line]
    assert main(["config", "show", tiny, "--set", "testing.step_sleep_s=0.1"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["testing"]["step_sleep_s"] == 0.1


@pytest.mark.parametrize(("status", "cause", "code"), [("finished", None, 0), ("stopped", "user", 3)])
def test_train_says_how_to_continue_a_stopped_run_in_the_foreground(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    status: str,
    cause: str | None,
    code: int,
) -> None:
    """Issue 26: a stop pointed at `submit --resume`; `train` names the command that continues a
    foreground run. Its last line is the end (in a terminal it follows the progress line)."""
    import hpclaunch.rundir as rundir
    from hpclaunch.cli import run_cmd
    from hpclaunch.rundir import AttemptOutcome

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(run_cmd, "_attempts_in_the_foreground", lambda run_dir: 0)
    monkeypatch.setattr(rundir, "latest_outcome", lambda paths: AttemptOutcome(status, cause, 7))  # type: ignore[arg-type]
    monkeypatch.setattr("hpclaunch.orchestrator.refusals.refuse_bad_data", lambda cfg: None)
    tiny = str(Path(__file__).resolve().parents[2] / "examples" / "tiny.yaml")
    assert main(["train", tiny, "--set", "name=fg"]) == code
    out = capsys.readouterr().out
    if status == "finished":
        assert out.strip() == "finished at step 7"
    else:
        assert f"continue it: hpclaunch train {tiny} --set name=fg --resume" in out


@pytest.mark.parametrize("command", [["submit"], ["train"], ["logs"], ["config", "show"], ["data", "synth"]])
def test_help_labels_no_flag_bool_and_no_python_list_type(
    command: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 26: help showed `<bool>` beside flags and `<list[Path]>` beside CONFIG."""
    assert main([*command, "--help"]) == 0
    text = capsys.readouterr().out
    assert "<bool>" not in text and "<list[" not in text
