"""The run's plan has one reader per need, both in ``rundir``: ``read_plan`` (strict, for whoever
runs the plan) and ``read_plan_view`` (tolerant, for the views); nothing else reads its keys."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from hpclaunch.rundir import RunPaths
from hpclaunch.rundir.clock import applied_limit_s, whole_minutes
from hpclaunch.rundir.plan_reader import PlanView, read_gpu_hour_cost, read_plan_view

pytestmark = pytest.mark.fast

SRC = Path(__file__).resolve().parents[2] / "src" / "hpclaunch"


def write(tmp_path: Path, plan: object) -> RunPaths:
    paths = RunPaths(tmp_path)
    paths.plan.write_text(plan if isinstance(plan, str) else json.dumps(plan))
    return paths


def test_a_plan_missing_optional_keys_reads_as_the_defaults(tmp_path: Path) -> None:
    view = read_plan_view(write(tmp_path, {"time_limit_s": 600, "scheduler": "local"}))
    assert view == PlanView(scheduler="local", time_limit_s=600.0)
    assert (view.nodes, view.spare_nodes, view.gpus_per_node, view.checkpoint_dir) == (1, 0, 0, None)
    assert view.applied_limit_s == 600.0


def test_an_older_plan_reads_what_it_has(tmp_path: Path) -> None:
    """A plan from before hot spares and checkpoint.dir, with a key this version no longer knows."""
    old = {"scheduler": "slurm", "time_limit_s": 3601, "nodes": 2, "gpus_per_node": 8, "retired_key": 1}
    view = read_plan_view(write(tmp_path, old))
    assert view is not None
    assert (view.nodes, view.spare_nodes, view.gpus_per_node) == (2, 0, 8)
    assert view.applied_limit_s == 61 * 60.0  # SLURM's whole minutes, rounded up


@pytest.mark.parametrize("text", ["", "{}", "[1, 2]", "not json"])
def test_no_readable_plan_reads_as_none(tmp_path: Path, text: str) -> None:
    assert read_plan_view(write(tmp_path, text)) is None
    assert read_plan_view(RunPaths(tmp_path / "missing")) is None


def test_keys_of_an_unknown_shape_read_as_the_defaults(tmp_path: Path) -> None:
    odd = {"scheduler": 3, "time_limit_s": "soon", "nodes": None, "spare_nodes": "x", "checkpoint_dir": 7}
    view = read_plan_view(write(tmp_path, odd))
    assert view == PlanView()
    assert view.applied_limit_s is None


def test_whole_minutes_have_one_home() -> None:
    assert whole_minutes(1) == 1 and whole_minutes(60) == 1 and whole_minutes(61) == 2
    assert applied_limit_s("slurm", 90) == 120.0
    assert applied_limit_s("pbs", 90) == applied_limit_s("local", 90) == 90.0


def test_the_price_comes_from_config_yaml(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path)
    assert read_gpu_hour_cost(paths) is None  # no config
    paths.config.write_text("scheduler:\n  gpu_hour_cost: 2.5\n")
    assert read_gpu_hour_cost(paths) == 2.5
    paths.config.write_text("scheduler: [oops]\n")
    assert read_gpu_hour_cost(paths) is None


def raw_plan_reads(path: Path, root: Path = SRC) -> list[str]:
    """Where ``path`` reads the plan's file or keys by hand: the file's name as a string (docstrings
    aside), ``X.plan.read_text()`` / ``read_bytes()`` / ``open()``, ``plan[...]`` or ``plan.get(...)``."""
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    found = []
    for node in ast.walk(tree):
        where = f"{path.relative_to(root)}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Constant) and id(node) not in docstrings and node.value == "plan.json":
            found.append(f"{where} names plan.json")
        elif (
            isinstance(node, ast.Attribute)
            and node.attr in ("read_text", "read_bytes", "open")
            and isinstance(node.value, ast.Attribute)
            and node.value.attr == "plan"
        ):
            found.append(f"{where} reads the plan's file")
        elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == "plan":
            found.append(f"{where} reads plan[...]")
        elif (
            isinstance(node, ast.Attribute)
            and node.attr == "get"
            and isinstance(node.value, ast.Name)
            and node.value.id == "plan"
        ):
            found.append(f"{where} reads plan.get(...)")
    return found


def test_the_plan_is_read_by_key_only_in_rundir() -> None:
    outside = [p for p in sorted(SRC.rglob("*.py")) if p.relative_to(SRC).parts[0] != "rundir"]
    found = [hit for p in outside for hit in raw_plan_reads(p)]
    assert found == [], "read the plan through rundir (read_plan, or read_plan_view for views)"


def test_the_check_finds_a_raw_read(tmp_path: Path) -> None:
    """The check above would have caught what it was written for (init_source and time_inputs)."""
    probe = tmp_path / "raw.py"
    probe.write_text(
        'import json\ndef f(run, paths):\n    x = json.loads((run / "plan.json").read_text())\n'
        "    plan = json.loads(paths.plan.read_text())\n    return plan['nodes'], plan.get('a'), x\n"
    )
    assert len(raw_plan_reads(probe, tmp_path)) == 4


def test_a_plan_with_torchruns_entry_still_reads(tmp_path: Path) -> None:
    """Issue 47: ``torchrun`` (``TorchrunPlan``: the plan's counts again, and fields read by nothing)
    left the plan. A plan.json written before still reads, strictly and as a view; one written now
    holds no such entry."""
    from hpclaunch.config import load_config
    from hpclaunch.orchestrator.plan_build import build
    from hpclaunch.rundir import read_plan

    plan = build(load_config(None, ["scheduler.kind=slurm", "scheduler.nodes=2"]), python="python3")
    now = plan.model_dump(mode="json")
    assert "torchrun" not in now
    old = {
        **now,
        "torchrun": {
            "nnodes": 2,
            "nproc_per_node": plan.procs_per_node,
            "rdzv_port": 29500,
            "max_restarts": 0,
            "shutdown_timeout_s": 60,
        },
    }
    paths = write(tmp_path, old)
    assert read_plan(paths) == plan
    view = read_plan_view(paths)
    assert view is not None and (view.scheduler, view.nodes) == ("slurm", 2)
    # The recorded run (an older version's plan.json, torchrun's entry included) reads too.
    recorded = RunPaths(Path(__file__).resolve().parent / "recorded" / "requeued_run")
    assert "torchrun" in json.loads(recorded.plan.read_text())
    assert read_plan(recorded).nodes == 1


def test_a_plan_written_before_the_agents_part_gets_it_from_its_config(tmp_path: Path) -> None:
    """Issue 47: the agent reads the plan alone; what it needs of the config is the plan's ``agent``
    part. A plan.json written before that part existed gets it from the run's config.yaml."""
    from hpclaunch.config import load_config
    from hpclaunch.orchestrator.plan_build import build
    from hpclaunch.rundir import read_config, read_plan
    from hpclaunch.rundir.plan import AgentPlan

    cfg = load_config(None, ["watchdog.launch_s=77", "testing.pause_before_continue_s=1.5"])
    plan = build(cfg, python="python3")
    assert plan.agent.watchdog.launch_s == 77 and plan.agent.testing.pause_before_continue_s == 1.5
    old = {k: v for k, v in plan.model_dump(mode="json").items() if k != "agent"}
    paths = write(tmp_path, old)
    assert read_plan(paths).agent == AgentPlan()  # no config beside it: the defaults
    paths.config.write_text(cfg.to_yaml())
    assert read_plan(paths) == plan
    recorded = RunPaths(Path(__file__).resolve().parent / "recorded" / "requeued_run")
    assert "agent" not in json.loads(recorded.plan.read_text())
    assert (
        read_plan(recorded).agent.watchdog == read_config(recorded).watchdog
    )  # (its retired keys read past)
