"""A run directory's '%' and ':' in the paths handed to the scheduler, and its spaces and '$' in the
commands hpclaunch suggests.

- SLURM expands ``%`` patterns in every file name it is given (``#SBATCH --output``, ``srun
  --output``, ``--error``): the run directory's own ``%`` is doubled there (``%%``: a literal
  ``%``), hpclaunch's patterns (``%j``, ``%t``, ``%A_%a``) stay.
- qsub reads ``#PBS -o``/``-e`` as ``[host:]path``: an absolute path has no host part, its ':' stays;
  a '%' is refused for Torque (one line naming run_dir, exit 2), whose tested target (Slurm's
  Torque emulation) reads the path as a SLURM pattern.
- A command suggested to the user ("continue it: hpclaunch submit --resume RUN") has every path
  and value quoted by the one quoting function: copied into a shell, it names the same run.
"""

from __future__ import annotations

import io
import re
import shlex
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from rich.console import Console

from hpclaunch.cli import main, train_end, views
from hpclaunch.config import load_config
from hpclaunch.errors import UserInputError
from hpclaunch.orchestrator.launch import prepare
from hpclaunch.rundir import AttemptOutcome, RunPaths
from hpclaunch.schedulers import pbs, slurm, submitit_adapter
from hpclaunch.templates.shell import pbs_output_path

pytestmark = pytest.mark.fast

TINY = Path(__file__).resolve().parents[2] / "examples" / "tiny.yaml"
PYTHON = "launch.python=/opt/venv/bin/python"


def slurm_expands(pattern: str, *, job: str = "123", array_job: str = "120", task: str = "0") -> str:
    """What SLURM makes of a file-name pattern (the subset hpclaunch writes, plus %% and any other
    letter it would also replace): the name the log really gets."""
    values = {"j": job, "t": task, "A": array_job, "a": "3", "%": "%", "N": "node1", "u": "me", "x": "job"}
    return re.sub(r"%(.)", lambda m: values.get(m.group(1), f"<{m.group(1)}>"), pattern)


def render(kind: str, run_dir: Path, *more: str) -> str:
    cfg = load_config(
        None, [f"scheduler.kind={kind}", f"run_dir={run_dir}", PYTHON, *more], base=run_dir.parent
    )
    return prepare(cfg).rendered.text


# ---- 1. SLURM: the run directory's '%' in file-name patterns --------------------------------------


@pytest.mark.parametrize("name", ["a%jb", "x%%y", "p%tq%A"])
def test_sbatch_and_srun_logs_land_in_the_run_directory_whatever_its_percent_signs(
    tmp_path: Path, name: str
) -> None:
    run = tmp_path / name
    text = render("slurm", run)
    sbatch = re.search(r"^#SBATCH --output=(\S+)$", text, re.M)
    srun = re.search(r"^srun .*--output (\S+) ", text, re.M)
    assert sbatch is not None and srun is not None, text
    folder = run / "scheduler" / "submitit"
    assert slurm_expands(sbatch.group(1)) == f"{folder}/123_0_log.out"
    assert slurm_expands(srun.group(1), task="1") == f"{folder}/123_1_log.out"
    # the agent's own argument is a plain argv word, not a pattern: the directory as it is
    assert text.rstrip().endswith(f" {shlex.quote(str(run))}")


def test_a_sweeps_array_logs_keep_their_array_patterns(tmp_path: Path) -> None:
    run = tmp_path / "sw%j"
    text = submitit_adapter.sbatch_text(
        command="true", folder=run / "scheduler" / "submitit", map_count=2, array_parallelism=2
    )
    out = re.search(r"^#SBATCH --output=(\S+)$", text, re.M)
    assert out is not None
    assert slurm_expands(out.group(1)) == f"{run}/scheduler/submitit/120_3_0_log.out"


def test_a_separate_error_log_is_escaped_as_well(tmp_path: Path) -> None:
    folder = tmp_path / "e%x" / "logs"
    text = submitit_adapter.sbatch_text(command="true", folder=folder, stderr_to_stdout=False)
    err = re.search(r"^#SBATCH --error=(\S+)$", text, re.M)
    srun_err = re.search(r"^srun .*--error (\S+) ", text, re.M)
    assert err is not None and srun_err is not None, text
    assert slurm_expands(err.group(1)) == f"{folder}/123_0_log.err"
    assert slurm_expands(srun_err.group(1), task="2") == f"{folder}/123_2_log.err"


def test_the_rescue_log_lands_in_the_run_directory(tmp_path: Path) -> None:
    run = tmp_path / "r%j"
    cfg = load_config(None, ["scheduler.kind=slurm", f"run_dir={run}", PYTHON], base=tmp_path)
    text = slurm.render_rescue(prepare(cfg).plan).text
    out = re.search(r"^#SBATCH --output=(\S+)$", text, re.M)
    assert out is not None
    assert slurm_expands(out.group(1)) == f"{run}/scheduler/rescue-123.out"


# ---- 2. PBS: ':' (and Torque's '%') in the -o path ------------------------------------------------


@pytest.mark.parametrize("dialect", ["pro", "torque"])
def test_a_colon_in_an_absolute_run_directory_is_the_paths_and_a_relative_one_is_refused(
    tmp_path: Path, dialect: str
) -> None:
    """qsub's ``[host:]path``: a path that begins with '/' has no host part (a run named with a
    time, 12:30, renders); the job and the rescue write the same."""
    run = tmp_path / "run-12:30"
    assert f"#PBS -o {run}/logs/\n" in render("pbs", run, f"scheduler.pbs_dialect={dialect}")
    cfg = load_config(
        None,
        ["scheduler.kind=pbs", f"scheduler.pbs_dialect={dialect}", f"run_dir={run}", PYTHON],
        base=tmp_path,
    )
    assert f"#PBS -o {run}/scheduler/\n" in pbs.render_rescue(prepare(cfg).plan).text
    with pytest.raises(UserInputError, match=r"\[host:\]path") as e:
        pbs_output_path("x:z/logs/", what="run_dir", dialect=dialect)
    assert e.value.where == "run_dir"


def test_a_percent_sign_is_refused_for_torque_and_kept_for_pbs_pro(tmp_path: Path) -> None:
    run = tmp_path / "a%jb"
    with pytest.raises(UserInputError, match="Torque emulation") as e:
        render("pbs", run, "scheduler.pbs_dialect=torque")
    assert e.value.where == "run_dir"
    # PBS Pro / OpenPBS take -o as it is (no patterns): the path, unchanged
    assert f"#PBS -o {run}/logs/\n" in render("pbs", run, "scheduler.pbs_dialect=pro")


# ---- 3. suggested commands: every path and value quoted ------------------------------------------

WEIRD = "sp ace$x"


def _view(run: str, state: str) -> Any:
    last = SimpleNamespace(cause="user", error="boom")
    return SimpleNamespace(run=run, attempts=[last], step=54, state=state, hint=None)


def _suggested(line: str, start: str) -> list[str]:
    """The command after ``start`` (up to the end of the line), as a shell would split it."""
    return shlex.split(line.split(start, 1)[1])


@pytest.mark.parametrize(
    ("state", "start", "argv"),
    [
        ("stopped", "continue it: ", ["hpclaunch", "submit", "--resume"]),
        ("failed", "see ", ["hpclaunch", "logs"]),
        ("cancelled", "checkpoint: ", ["hpclaunch", "submit", "--resume"]),
    ],
)
def test_the_line_after_a_wait_names_the_run_as_a_shell_reads_it(
    tmp_path: Path, state: str, start: str, argv: list[str]
) -> None:
    run = str(tmp_path / WEIRD)
    assert _suggested(views.ended_line(_view(run, state)), start) == [*argv, run]
    plain = str(tmp_path / "plain")
    assert views.ended_line(_view(plain, state)).endswith(f"{' '.join(argv)} {plain}")  # unquoted


def _last_word(
    monkeypatch: pytest.MonkeyPatch, paths: RunPaths, config: list[Path], overrides: list[str]
) -> str:
    out = io.StringIO()
    monkeypatch.setattr(train_end, "console", Console(file=out, force_terminal=False, width=80))
    monkeypatch.setattr(train_end, "foreground_outcome", lambda p: AttemptOutcome("stopped", "user", 7))
    assert train_end.last_word(paths, config, overrides, 0) == 3
    return out.getvalue()


def test_train_says_how_to_continue_with_every_word_quoted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "my run [b].yaml"
    said = _last_word(monkeypatch, RunPaths(tmp_path / "r"), [config], ["name=a b", "train.steps=9"])
    assert "\n" not in said.rstrip("\n")  # one line, never wrapped
    assert _suggested(said, "continue it: ") == [
        "hpclaunch", "train", str(config), "--set", "name=a b", "--set", "train.steps=9", "--resume"
    ]  # fmt: skip
    plain = _last_word(monkeypatch, RunPaths(tmp_path / "r"), [Path("my.yaml")], ["name=fg"])
    assert "continue it: hpclaunch train my.yaml --set name=fg --resume" in plain


@pytest.mark.parametrize("given", ["none", "own"])
def test_train_of_a_run_directory_or_a_script_names_the_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, given: str
) -> None:
    """`train RUN --resume` (its own config.yaml) and `train --script S` (no CONFIG): the command
    that continues them names the run directory (``hpclaunch train`` with no CONFIG is refused)."""
    paths = RunPaths(tmp_path / WEIRD)
    config = [] if given == "none" else [paths.config]
    said = _last_word(monkeypatch, paths, config, [])
    assert _suggested(said, "continue it: ") == ["hpclaunch", "train", str(paths.root), "--resume"]


@pytest.mark.parametrize("command", ["stop", "cancel"])
def test_stop_and_cancel_of_an_ended_run_hint_a_status_command_that_works(
    tmp_path: Path, command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.unit.test_run_kinds import stopped_run

    run = stopped_run(tmp_path / WEIRD)
    assert main([command, str(run)]) == 2
    hint = next(line for line in capsys.readouterr().err.splitlines() if "hint:" in line)
    assert _suggested(hint.split(";")[0], "see ") == ["hpclaunch", "status", str(run)]
