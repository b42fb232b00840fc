"""What hpclaunch takes from submitit behaves as the adapter expects (fails when submitit changes)."""

from __future__ import annotations

import re
from importlib.metadata import version
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from hpclaunch.schedulers import submitit_adapter

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parents[2]


def test_installed_submitit_is_in_the_tested_range_and_pyproject_pins_it() -> None:
    assert version("submitit") in SpecifierSet(submitit_adapter.TESTED)
    line = re.search(r'^\s*"(submitit[^"]*)"', (ROOT / "pyproject.toml").read_text(), re.M)
    assert line is not None
    pinned = Requirement(line.group(1))
    assert pinned.specifier == SpecifierSet(submitit_adapter.TESTED)


def test_the_sbatch_formatter_renders_what_the_lint_and_the_agent_rely_on(tmp_path: Path) -> None:
    text = submitit_adapter.sbatch_text(
        command="/venv/bin/python -u -m hpclaunch.jobs.agent /runs/x",
        folder=tmp_path,
        job_name="x",
        time=5,
        nodes=2,
        ntasks_per_node=1,
        cpus_per_task=4,
        signal_delay_s=75,
        stderr_to_stdout=True,
        wckey=None,
        setup=["export A=1"],
        additional_parameters={"requeue": True},
        srun_args=["--kill-on-bad-exit=1"],
    )
    lines = text.splitlines()
    assert lines[0] == "#!/bin/bash"
    for directive in (
        "#SBATCH --signal=USR2@75",
        "#SBATCH --open-mode=append",
        "#SBATCH --requeue",
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --output={tmp_path}/%j_%t_log.out".replace("%t", "0"),
    ):
        assert directive in lines, directive
    assert not any(line.startswith("#SBATCH --error") for line in lines)  # stderr joins stdout
    assert "export A=1" in lines
    # submitit's marker for its own JobEnvironment: dropped, nothing in the job reads it
    assert submitit_adapter.SUBMITIT_MARKER not in lines and lines[-2] == "# command"
    # The command is the last line, run by srun on every node, unchanged.
    assert lines[-1] == (
        f"srun --unbuffered --output {tmp_path}/%j_%t_log.out --kill-on-bad-exit=1 "
        "/venv/bin/python -u -m hpclaunch.jobs.agent /runs/x"
    )


def test_arrays_get_one_log_per_task(tmp_path: Path) -> None:
    text = submitit_adapter.sbatch_text(command="true", folder=tmp_path, map_count=3, array_parallelism=2)
    assert "#SBATCH --array=0-2%2" in text.splitlines()
    assert re.search(r"--output \S+/%A_%a_%t_log\.out", text)


def test_the_parsable_sacct_watcher_reads_states() -> None:
    from submitit.slurm.slurm import SlurmInfoWatcher

    info = SlurmInfoWatcher().read_info(
        "JobID|State|NodeList\n12|PREEMPTED|n1\n12.batch|CANCELLED|n1\n13_0|TIMEOUT|n2\n"
    )
    assert info["12"]["State"] == "PREEMPTED" and info["13_0"]["State"] == "TIMEOUT"
