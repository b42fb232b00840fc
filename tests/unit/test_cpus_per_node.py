"""CPUs per node follow the ranks (issue 46, item 1): a 2 x 4-GPU job asked for 2 CPUs per node and
set OMP_NUM_THREADS=1, four ranks, their loaders and writers sharing two CPUs, with no word said.

The default is ranks x (loader workers + 2: the rank, its workers, its checkpoint writer); ``all``
asks for whole nodes; OMP_NUM_THREADS is each rank's share less its helpers; a user's count below
ranks x (workers + 1) is warned about by render, submit and preflight."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpclaunch.cli import main
from hpclaunch.config import RunConfig, load_config
from hpclaunch.errors import ConfigError
from hpclaunch.orchestrator.launch import prepare
from hpclaunch.preflight import Status
from hpclaunch.preflight.check_context import CheckContext, CommandResult
from hpclaunch.preflight.layout import check_config
from hpclaunch.preflight.probe import StaticProbe
from hpclaunch.preflight.scheduler_check import check_scheduler

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parents[2]
FIXED = ["launch.python=/opt/venv/bin/python", "run_dir=/runs/x"]
TWO_BY_FOUR = [*FIXED, "scheduler.nodes=2", "scheduler.gpus_per_node=4", "scheduler.procs_per_node=null"]
TWO_BY_FOUR += ["train.global_batch=64"]


def script(*overrides: str, kind: str = "slurm", example: str = "tiny.yaml") -> str:
    flags = [("scheduler.kind=" + kind, "--scheduler")]
    cfg = load_config(ROOT / "examples" / example, list(overrides), base=ROOT, flags=flags)
    return prepare(cfg).rendered.text


def test_two_nodes_of_four_gpus_ask_for_the_ranks_share_on_slurm_and_pbs() -> None:
    slurm = script(*TWO_BY_FOUR)
    # 4 ranks x (1 loader worker + the rank + its writer)
    assert "#SBATCH --cpus-per-task=12\n" in slurm and "export OMP_NUM_THREADS=1\n" in slurm
    assert "select=2:ncpus=12:ngpus=4:mpiprocs=1" in script(*TWO_BY_FOUR, kind="pbs")
    more = script(*TWO_BY_FOUR, "scheduler.gpus_per_node=8", "data.num_workers=4")
    assert "#SBATCH --cpus-per-task=48\n" in more  # 8 x (4 + 2)


def test_a_given_count_shares_out_to_each_ranks_threads() -> None:
    text = script(
        *TWO_BY_FOUR, "scheduler.gpus_per_node=8", "scheduler.cpus_per_node=96", "data.num_workers=4"
    )
    # 96 / 8 ranks = 12 each, less 4 loader workers and the writer
    assert "#SBATCH --cpus-per-task=96\n" in text and "export OMP_NUM_THREADS=7\n" in text
    own = script(*TWO_BY_FOUR, "scheduler.cpus_per_node=96", "launch.env={OMP_NUM_THREADS: 3}")
    assert "export OMP_NUM_THREADS=3\n" in own  # the user's own value wins


def test_whole_nodes_on_slurm_and_pbs_pro_count_the_threads_on_the_node() -> None:
    slurm = script(*TWO_BY_FOUR, "scheduler.cpus_per_node=all")
    assert "#SBATCH --exclusive\n" in slurm and "--cpus-per-task" not in slurm
    assert 'export SRUN_CPUS_PER_TASK="$SLURM_CPUS_ON_NODE"\n' in slurm
    assert "OMP_NUM_THREADS=$(( $(nproc) / 4 - 2 ))\n" in slurm and "export OMP_NUM_THREADS\n" in slurm
    pbs = script(*TWO_BY_FOUR, "scheduler.cpus_per_node=all", kind="pbs")
    assert "#PBS -l select=2:ncpus=12:ngpus=4:mpiprocs=1\n#PBS -l place=scatter:excl\n" in pbs
    with pytest.raises(ConfigError, match="Torque dialect cannot"):
        script(*TWO_BY_FOUR, "scheduler.cpus_per_node=all", "scheduler.pbs_dialect=torque", kind="pbs")


def test_the_old_key_is_read_and_the_new_one_wins_from_a_later_layer(tmp_path: Path) -> None:
    old = tmp_path / "old.yaml"
    old.write_text("scheduler: {kind: slurm, cpus_per_task: 8}\n")
    assert load_config(old).scheduler.cpus_per_node == 8  # a config (or run directory) from before
    assert load_config(old, ["scheduler.cpus_per_task=16"]).scheduler.cpus_per_node == 16
    assert load_config(old, ["scheduler.cpus_per_node=all"]).scheduler.cpus_per_node == "all"
    newer = tmp_path / "newer.yaml"
    newer.write_text("scheduler: {cpus_per_node: 32}\n")
    assert load_config([old, newer]).scheduler.cpus_per_node == 32
    both = tmp_path / "both.yaml"
    both.write_text("scheduler: {cpus_per_task: 8, cpus_per_node: 16}\n")
    with pytest.raises(ConfigError, match=r"old name of scheduler\.cpus_per_node; the file sets both"):
        load_config(both)


@pytest.mark.parametrize("value", ["0", "-4", "lots", "5000"])
def test_a_bad_count_is_one_line(value: str) -> None:
    with pytest.raises(ConfigError, match=f"'?{value}'? is not a CPU count from 1 to 4096, all"):
        load_config(None, [f"scheduler.cpus_per_node={value}"])


def test_render_and_preflight_warn_when_the_loaders_are_starved(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    starved = [*TWO_BY_FOUR, "scheduler.cpus_per_node=2"]
    args = ["render", str(ROOT / "examples/tiny.yaml"), "--scheduler", "slurm"]
    assert main([*args, *(a for o in starved for a in ("--set", o))]) == 0
    err = capsys.readouterr().err
    assert "scheduler.cpus_per_node 2 is fewer than the 4 rank(s) x (data.num_workers 1 + 1) = 8" in err
    flags = [("scheduler.kind=slurm", "--scheduler")]
    cfg = load_config(ROOT / "examples/tiny.yaml", starved, base=ROOT, flags=flags)
    out = check_config(CheckContext(cfg=cfg, node=None, probe=StaticProbe(None)))
    assert out.status is Status.WARN and "is fewer than the 4 rank(s)" in out.finding
    fed = load_config(ROOT / "examples/tiny.yaml", TWO_BY_FOUR, base=ROOT, flags=flags)
    assert fed.cpu_shortfall() is None
    out = check_config(CheckContext(cfg=fed, node=None, probe=StaticProbe(None)))
    assert "12 CPUs per node (OMP_NUM_THREADS 1)" in out.finding
    local = load_config(ROOT / "examples/tiny.yaml", ["scheduler.cpus_per_node=1"], base=ROOT)
    assert local.cpu_shortfall() is None  # the local scheduler allocates nothing


def test_preflight_fails_a_partition_whose_nodes_have_fewer_cpus(tmp_path: Path) -> None:
    sinfo = "gpu*|up|infinite|n1|idle|gpu:4|(null)|8\ngpu*|up|infinite|n2|idle|gpu:4|(null)|8\n"
    raw = {"scheduler": {"kind": "slurm", "nodes": 2, "gpus_per_node": 4}, "train": {"global_batch": 64}}
    cfg = RunConfig.model_validate(raw).resolved(tmp_path)
    ctx = CheckContext(
        cfg=cfg,
        node=None,
        probe=StaticProbe(),
        run=lambda argv, timeout: CommandResult(0, sinfo, "") if argv[0] == "sinfo" else None,
        which=lambda tool: f"/usr/bin/{tool}",
    )
    out = check_scheduler(ctx)
    assert out.status is Status.FAIL
    assert "has 0 node(s) with >= 4 GPUs (gres) and >= 12 CPUs; the run asks for 2" in out.finding
