"""Bad input: exit code 2, one readable line naming the key, no traceback, nothing written."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

GOOD = """\
name: ok
scheduler: {kind: slurm, nodes: 2, cpus_per_task: 4}
train: {global_batch: 8}
"""

# (id, YAML text or None for GOOD, extra --set overrides, text the error line must contain)
CASES = [
    ("malformed-yaml", "name: [unclosed\n", [], "not valid YAML"),
    ("top-level-list", "- a\n- b\n", [], "top level must be a mapping"),
    ("unknown-top-key", "nmae: x\n", [], "unknown key 'nmae' (did you mean name?)"),
    (
        "unknown-nested-key",
        None,
        ["scheduler.nodse=3"],
        "unknown key 'scheduler.nodse' (did you mean scheduler.nodes?)",
    ),
    (
        "unknown-section-key",
        "train: {stpes: 3}\n",
        [],
        "unknown key 'train.stpes' (did you mean train.steps?)",
    ),
    ("wrong-type", None, ["scheduler.nodes=two"], "scheduler.nodes: Input should be a valid integer"),
    (
        "zero-nodes",
        None,
        ["scheduler.nodes=0"],
        "scheduler.nodes: Input should be greater than or equal to 1",
    ),
    ("negative-cpus", None, ["scheduler.cpus_per_task=-4"], "scheduler.cpus_per_node: -4 is not a CPU count"),
    ("negative-lr", None, ["train.lr=-1"], "train.lr: Input should be greater than 0"),
    (
        "bad-time-format",
        None,
        ["scheduler.time_limit=1h30"],
        "scheduler.time_limit: '1h30' is not a duration",
    ),
    ("time-too-short", None, ["scheduler.time_limit=5s"], "scheduler.time_limit"),
    (
        "bad-scheduler-kind",
        None,
        ["scheduler.kind=lsf"],
        "scheduler.kind: Input should be 'local', 'slurm' or 'pbs'",
    ),
    ("bad-nccl-preset", None, ["nccl.preset=infiniband"], "nccl.preset"),
    ("bad-run-name", None, ["name=my run; rm -rf /"], "is not a run name"),
    ("partition-shell", None, ["scheduler.partition=gpu;reboot"], "scheduler.partition"),
    (
        "batch-not-divisible",
        None,
        ["train.global_batch=9"],
        "train.global_batch: 9 is not divisible by the 2 ranks",
    ),
    (
        "lead-longer-than-walltime",
        None,
        ["scheduler.time_limit=00:05:00", "launch.stop_lead_s=600"],
        "launch.stop_lead_s: 600 is not shorter",
    ),
    (
        "pbs-dialect-on-slurm",
        None,
        ["scheduler.pbs_dialect=torque"],
        "scheduler.pbs_dialect: only applies to kind: pbs",
    ),
    ("bf16-on-cpu", None, ["train.precision=bf16"], "train.precision: bf16 needs GPUs"),
    ("nccl-backend-on-cpu", None, ["launch.backend=nccl"], "launch.backend: nccl needs GPUs"),
    (
        "procs-over-gpus",
        None,
        ["scheduler.gpus_per_node=2", "scheduler.procs_per_node=4", "train.global_batch=16"],
        "scheduler.procs_per_node: 4 is more than gpus_per_node=2",
    ),
    (
        "bad-env-name",
        None,
        ["launch.env={BAD-NAME: x}"],
        "launch.env: 'BAD-NAME' is not a valid environment variable name",
    ),
    ("override-without-equals", None, ["train.lr"], "is not of the form dotted.key=value"),
    (
        "warmup-too-long",
        None,
        ["train.warmup_steps=500"],
        "train.warmup_steps: 500 must be smaller than train.steps=200",
    ),
    ("betas-length", None, ["train.betas=[0.9]"], "train.betas: [0.9] must be two values"),
    (
        "nccl-ignored-value",
        None,
        ["nccl.env.NCCL_NET_GDR_LEVEL=PBH"],
        "'PBH' is not a level NCCL knows (did you mean PHB?)",
    ),
    ("nccl-nonexistent", None, ["nccl.env.NCCL_TIMEOUT=1800"], "NCCL_TIMEOUT: does not exist"),
    ("nccl-removed", None, ["nccl.env.NCCL_TREE_THRESHOLD=0"], "NCCL_TREE_THRESHOLD"),
    (
        "multiline-setup",
        None,
        ['scheduler.setup=["a\\nb"]'],
        "scheduler.setup.0: 'a\\nb' holds a control character",
    ),
    # "gpu\n" passed a `^...$` pattern (`$` matches before a final newline) and broke the #PBS -q
    # line, so every later directive was ignored.
    (
        "newline-partition",
        None,
        ['scheduler.partition="gpu\\n"'],
        "scheduler.partition: 'gpu\\n' holds a control character",
    ),
    # On PBS the old code rendered it, exit 0: `#PBS -q 'gpu` then a line `'`.
    (
        "newline-queue-on-pbs",
        None,
        ["scheduler.kind=pbs", 'scheduler.partition="gpu\\n"'],
        "scheduler.partition: 'gpu\\n' holds a control character",
    ),
    ("tab-in-env", None, ['launch.env.X="a\\tb"'], "launch.env.X: 'a\\tb' holds a control character"),
]


def run_cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "HPCLAUNCH_DEBUG"}
    return subprocess.run(
        [sys.executable, "-m", "hpclaunch", *args], cwd=cwd, capture_output=True, text=True, env=env
    )


@pytest.mark.parametrize("case_id,text,overrides,expected", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gives_exit_2_and_one_line(
    tmp_path: Path, case_id: str, text: str | None, overrides: list[str], expected: str
) -> None:
    config = tmp_path / "run.yaml"
    config.write_text(text if text is not None else GOOD)
    args = ["render", str(config)]
    for item in overrides:
        args += ["--set", item]
    result = run_cli(args, tmp_path)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines[0].startswith("hpclaunch: error:"), result.stderr
    assert expected in lines[0], lines[0]
    assert "Traceback" not in result.stderr
    assert len(lines) <= 2  # the error line and a hint line
    assert result.stdout == ""
    assert not (tmp_path / "runs").exists()  # nothing written


def test_debug_variable_shows_the_traceback(tmp_path: Path) -> None:
    config = tmp_path / "run.yaml"
    config.write_text("nmae: x\n")
    env = {**os.environ, "HPCLAUNCH_DEBUG": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "hpclaunch", "render", str(config)], capture_output=True, text=True, env=env
    )
    assert result.returncode != 0
    assert "Traceback" in result.stderr and "ConfigError" in result.stderr


def test_missing_config_file(tmp_path: Path) -> None:
    result = run_cli(["render", str(tmp_path / "nope.yaml")], tmp_path)
    assert result.returncode == 2
    assert "config file not found" in result.stderr


def test_a_value_given_for_a_section_names_the_section_not_an_internal_class() -> None:
    """Issue 26: `--set train=5` said "instance of TrainConfig"."""
    from hpclaunch.config import load_config
    from hpclaunch.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        load_config(None, ["train=5"])
    assert e.value.one_line() == "--set: train is a section, not a value (got 5)"
    assert e.value.hint is not None and e.value.hint.startswith("set one of its keys, e.g. train.seed=...")
    assert "Config" not in e.value.one_line()


def test_a_removed_key_is_named_removed_and_a_run_written_before_still_reads(tmp_path: Path) -> None:
    """Issue 49: ``launch.shutdown_timeout_s`` was documented and read by nothing; removed. A user's
    file or --set that names it is told so in one line; a run directory written before keeps it in
    its config.yaml, which still reads (its agents and ``submit --resume`` must go on)."""
    from hpclaunch.config import load_config
    from hpclaunch.errors import ConfigError
    from hpclaunch.rundir import RunPaths, read_config

    with pytest.raises(ConfigError) as e:
        load_config(None, ["launch.shutdown_timeout_s=60"])
    assert "'launch.shutdown_timeout_s' was removed: it was read by nothing" in e.value.one_line()
    paths = RunPaths(tmp_path).ensure()
    paths.config.write_text("name: old\nlaunch:\n  shutdown_timeout_s: 60\n  stop_margin_s: 30\n")
    assert read_config(paths).launch.stop_margin_s == 30
