"""--sweep: the cartesian product of axes as one job array, one run directory per point."""

from __future__ import annotations

import pytest

from hpclaunch.config import load_config
from hpclaunch.errors import UserInputError
from hpclaunch.orchestrator.launch import expand_sweep, prepare

pytestmark = pytest.mark.fast

SWEEPS = ["train.lr=1e-4,3e-4", "model.depth=2,4"]


def _cfg(*overrides: str):  # type: ignore[no-untyped-def]
    return load_config(None, ["name=sw", "run_dir=/runs/sw", "launch.python=/py", *overrides])


def test_points_are_the_cartesian_product_each_with_its_own_run_dir() -> None:
    points = expand_sweep(_cfg(), SWEEPS)
    assert [(n, o) for n, o, _ in points] == [
        ("p0-lr1e-4-depth2", ["train.lr=1e-4", "model.depth=2"]),
        ("p1-lr1e-4-depth4", ["train.lr=1e-4", "model.depth=4"]),
        ("p2-lr3e-4-depth2", ["train.lr=3e-4", "model.depth=2"]),
        ("p3-lr3e-4-depth4", ["train.lr=3e-4", "model.depth=4"]),
    ]
    cfgs = [c for _, _, c in points]
    assert [c.train.lr for c in cfgs] == [1e-4, 1e-4, 3e-4, 3e-4]
    assert [c.model.depth for c in cfgs] == [2, 4, 2, 4]
    assert cfgs[3].run_dir == "/runs/sw/p3-lr3e-4-depth4"


@pytest.mark.parametrize(
    "kind,dialect,line",
    [
        ("slurm", None, "#SBATCH --array=0-3%4"),
        ("pbs", "pro", "#PBS -J 0-3"),
        ("pbs", "torque", "#PBS -t 0-3"),
    ],
)
def test_one_array_job_for_all_points(kind: str, dialect: str | None, line: str) -> None:
    extra = [f"scheduler.kind={kind}"] + ([f"scheduler.pbs_dialect={dialect}"] if dialect else [])
    text = prepare(_cfg(*extra), sweeps=SWEEPS).rendered.text
    assert line in text.splitlines()
    if kind == "pbs":  # each array task picks its point's run directory by its index
        assert "HPCLAUNCH_RUN_DIRS=(/runs/sw/p0-lr1e-4-depth2 " in text
        assert "${PBS_ARRAY_INDEX:-${PBS_ARRAYID:?not an array task}}" in text


def test_array_parallelism_limits_concurrent_points() -> None:
    text = prepare(_cfg("scheduler.kind=slurm", "scheduler.array_parallelism=2"), sweeps=SWEEPS).rendered.text
    assert "#SBATCH --array=0-3%2" in text


@pytest.mark.parametrize("bad", ["scheduler.nodes=1,2", "train.lr", "name=a,b", "train.lr="])
def test_bad_sweeps_are_refused(bad: str) -> None:
    with pytest.raises(UserInputError):
        expand_sweep(_cfg(), [bad])
