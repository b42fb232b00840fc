"""Rendered job scripts for the examples, pinned by golden files; `make golden` accepts a change.

Paths that differ between machines (run directory, the job's Python) are fixed by overrides so
the goldens are byte-stable; everything else is exactly what `hpclaunch render` prints.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from hpclaunch.cli.render_cmd import scheduler_flags
from hpclaunch.config import load_config
from hpclaunch.orchestrator.launch import prepare

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "golden"
FIXED = ["launch.python=/opt/venv/bin/python"]

CASES = [
    ("slurm-8xh100.sbatch", "examples/slurm-8xh100.yaml", None, None, ["run_dir=/runs/mmdit-8xh100"]),
    ("pbs-pro.pbs", "examples/pbs-pro.yaml", None, None, ["run_dir=/runs/mmdit-pbs"]),
    ("pbs-torque.pbs", "examples/pbs-pro.yaml", None, "torque", ["run_dir=/runs/mmdit-pbs"]),
    ("slurm-8xh100-as-pbs.pbs", "examples/slurm-8xh100.yaml", "pbs", None, ["run_dir=/runs/mmdit-8xh100"]),
    ("tiny.local.sh", "examples/tiny.yaml", None, None, ["run_dir=/runs/tiny"]),
    ("tiny-as-slurm.sbatch", "examples/tiny.yaml", "slurm", None, ["run_dir=/runs/tiny"]),
    # Containers (issue 37): each runtime's command line, as the agent runs it, in a comment.
    ("slurm-8xh100-pyxis.sbatch", "examples/slurm-8xh100.yaml", None, None, ["run_dir=/runs/mmdit-8xh100",
        "container.runtime=pyxis", "container.image=nvcr.io#nvidia/pytorch:24.05-py3", "container.python=python",
        "container.mounts=[/scratch]", "container.env=[HF_HOME]"]),
    ("slurm-8xh100-apptainer.sbatch", "examples/slurm-8xh100.yaml", None, None, ["run_dir=/runs/mmdit-8xh100",
        "container.runtime=apptainer", "container.image=/images/mmdit.sif", "container.env=[HF_HOME]"]),
    ("pbs-pro-apptainer.pbs", "examples/pbs-pro.yaml", None, None, ["run_dir=/runs/mmdit-pbs",
        "container.runtime=apptainer", "container.image=/images/mmdit.sif"]),
    ("tiny-charliecloud.local.sh", "examples/tiny.yaml", None, None, ["run_dir=/runs/tiny",
        "data.token_dir=/data/tiny/tokens", "data.latent_dir=/data/tiny/latents",
        "container.runtime=charliecloud", "container.image=/images/mmdit", "container.python=/opt/venv/bin/python"]),
]  # fmt: skip


def render(example: str, scheduler: str | None, dialect: str | None, overrides: list[str]) -> str:
    cfg = load_config(
        ROOT / example, [*FIXED, *overrides], base=ROOT, flags=scheduler_flags(scheduler, dialect)
    )
    return prepare(cfg).rendered.text


@pytest.mark.parametrize("golden,example,scheduler,dialect,overrides", CASES, ids=[c[0] for c in CASES])
def test_rendered_script_matches_golden(
    golden: str, example: str, scheduler: str | None, dialect: str | None, overrides: list[str]
) -> None:
    text = render(example, scheduler, dialect, overrides)
    path = GOLDEN / golden
    if os.environ.get("HPCLAUNCH_UPDATE_GOLDEN"):
        path.write_text(text)
    assert path.exists(), f"no golden file {path}; run `make golden` and review it"
    assert text == path.read_text(), f"{golden} changed; review the diff and run `make golden` to accept it"


@pytest.mark.parametrize("golden", [c[0] for c in CASES])
def test_golden_scripts_are_valid_bash(golden: str) -> None:
    result = subprocess.run(["bash", "-n", str(GOLDEN / golden)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_every_number_comes_from_the_plan() -> None:
    text = render(
        "examples/slurm-8xh100.yaml",
        None,
        None,
        [
            "run_dir=/runs/x",
            "scheduler.nodes=3",
            "scheduler.cpus_per_node=77",
            "train.global_batch=48",
            "train.micro_batch=null",
        ],
    )
    assert "#SBATCH --nodes=3" in text
    assert "#SBATCH --cpus-per-task=77" in text
    assert text.count("=3\n") == 1  # the node count is written once; the agent gets it from the plan
    pbs = render(
        "examples/pbs-pro.yaml",
        None,
        None,
        ["run_dir=/runs/x", "scheduler.nodes=3", "train.global_batch=48", "train.micro_batch=null"],
    )
    assert "select=3:ncpus=64:ngpus=4:mpiprocs=1" in pbs and "mpiexec -n 3 --ppn 1" in pbs


def test_config_hash_ignores_where_the_checkout_and_data_live(tmp_path: Path) -> None:
    # CI checks the repo out elsewhere; relative data paths then resolve to other absolute
    # paths. The hash (printed in every script, compared on resume) must not move with them.
    here = load_config(ROOT / "examples/tiny.yaml", FIXED, base=ROOT)
    there = load_config(ROOT / "examples/tiny.yaml", FIXED, base=tmp_path)
    assert here.data.token_dir != there.data.token_dir
    assert here.config_hash() == there.config_hash()
    assert prepare(here).rendered.text.replace(str(ROOT), "") == prepare(there).rendered.text.replace(
        str(tmp_path), ""
    )
    # ...while a change to the math still changes it.
    other_lr = load_config(ROOT / "examples/tiny.yaml", [*FIXED, "train.lr=5e-4"], base=ROOT)
    assert other_lr.config_hash() != here.config_hash()


# The rescue job each SLURM/PBS job leaves behind (schedulers.rescue_job): `hpclaunch render --rescue`.
RESCUE_CASES = [
    ("slurm-8xh100.rescue.sbatch", "examples/slurm-8xh100.yaml", None, None, ["run_dir=/runs/mmdit-8xh100"]),
    ("pbs-pro.rescue.pbs", "examples/pbs-pro.yaml", None, None, ["run_dir=/runs/mmdit-pbs"]),
    ("pbs-torque.rescue.pbs", "examples/pbs-pro.yaml", None, "torque", ["run_dir=/runs/mmdit-pbs"]),
]


def render_rescue(example: str, scheduler: str | None, dialect: str | None, overrides: list[str]) -> str:
    from hpclaunch.cli.render_cmd import rescue_script

    cfg = load_config(
        ROOT / example, [*FIXED, *overrides], base=ROOT, flags=scheduler_flags(scheduler, dialect)
    )
    return rescue_script(prepare(cfg)).text


@pytest.mark.parametrize(
    "golden,example,scheduler,dialect,overrides", RESCUE_CASES, ids=[c[0] for c in RESCUE_CASES]
)
def test_rendered_rescue_script_matches_golden(
    golden: str, example: str, scheduler: str | None, dialect: str | None, overrides: list[str]
) -> None:
    text = render_rescue(example, scheduler, dialect, overrides)
    path = GOLDEN / golden
    if os.environ.get("HPCLAUNCH_UPDATE_GOLDEN"):
        path.write_text(text)
    assert path.exists(), f"no golden file {path}; run `make golden` and review it"
    assert text == path.read_text(), f"{golden} changed; review the diff and run `make golden` to accept it"
    result = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_the_rescue_script_quotes_what_reaches_the_shell() -> None:
    """A run directory that directives cannot carry is refused; the command line quotes the rest."""
    from hpclaunch.errors import UserInputError

    with pytest.raises(UserInputError, match="cannot be written into a #SBATCH"):
        render_rescue("examples/tiny.yaml", "slurm", None, ["run_dir=/runs/a'; echo foo"])
    text = render_rescue(
        "examples/tiny.yaml", "slurm", None, ["run_dir=/runs/x", "launch.python=/opt/my env/python"]
    )
    assert "exec '/opt/my env/python' -u -m hpclaunch.jobs.rescue /runs/x \"$1\"" in text
