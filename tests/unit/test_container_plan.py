"""The container section -> the plan's ContainerPlan -> each runtime's command line (issue 37).

What the agent runs is ``JobPlan.rank_host_argv``; `render` prints the same function's answer, quoted
by the one quoting function. These tests pin each runtime's line and what goes into it: the run
directory and the data at their own paths, GPUs, the names of the variables that pass (never
values), and the one node a pyxis step runs on.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from hpclaunch.config import load_config
from hpclaunch.errors import ConfigError
from hpclaunch.orchestrator.launch import prepare
from hpclaunch.orchestrator.plan_build import build
from hpclaunch.rundir.container import ContainerPlan, Mount
from hpclaunch.rundir.plan import JobPlan

pytestmark = pytest.mark.fast

BASE = [
    "run_dir=/runs/x",
    "data.token_dir=/data/tok",
    "data.latent_dir=/data/lat",
    "launch.python=/opt/venv/bin/python",
    "launch.pass_env=[WANDB_API_KEY]",
    "launch.env={WANDB_MODE: offline}",
]
LAUNCHER = ["-u", "-m", "hpclaunch.rank.host"]
SAME = ["/data/lat:/data/lat", "/data/tok:/data/tok", "/runs/x:/runs/x"]
# this user's node-local directory (``rundir.node_dir``), at /tmp/<its name> in every image; render
# shows its place holder, the agent its path on the node
NODE_DIR = "NODE_DIR:/tmp/NODE_DIR"
MOUNTED = [*SAME, NODE_DIR]


def plan_of(*overrides: str) -> JobPlan:
    cfg = load_config(None, [*BASE, *overrides], base=Path("/work"))
    return build(cfg, python="/usr/bin/python3")


def test_without_a_container_the_rank_host_runs_with_the_jobs_python() -> None:
    plan = plan_of()
    assert plan.container is None
    assert plan.rank_host_argv() == ["/opt/venv/bin/python", *LAUNCHER]


def test_charliecloud_binds_the_run_and_the_data_at_their_own_paths() -> None:
    plan = plan_of(
        "container.runtime=charliecloud", "container.image=img", "container.python=/opt/py/bin/python"
    )
    binds = [a for pair in zip(["-b"] * 4, MOUNTED, strict=True) for a in pair]
    # a relative image path resolves like the data directories
    assert plan.rank_host_argv() == [
        "ch-run", *binds, "-c", "/runs/x", "/work/img", "--", "/opt/py/bin/python", *LAUNCHER
    ]  # fmt: skip


def test_apptainer_binds_asks_for_gpus_and_passes_names_as_apptainerenv() -> None:
    plan = plan_of(
        "container.runtime=apptainer",
        "container.image=/img/m.sif",
        "scheduler.kind=slurm",
        "scheduler.gpus_per_node=2",
        "train.global_batch=16",
        "container.flags=[--writable-tmpfs]",
    )
    binds = [a for m in MOUNTED for a in ("--bind", m)]
    assert plan.rank_host_argv() == [
        "apptainer", "exec", "--nv", *binds, "--pwd", "/runs/x", "--writable-tmpfs", "/img/m.sif", "python3", *LAUNCHER
    ]  # fmt: skip
    assert plan.container is not None
    env = plan.container.environment(
        {"WANDB_API_KEY": "s3cret", "NCCL_IB_HCA": "mlx5", "HOME": "/h", "PATH": "/b"}
    )
    assert env["APPTAINERENV_WANDB_API_KEY"] == "s3cret" and env["APPTAINERENV_NCCL_IB_HCA"] == "mlx5"
    assert "APPTAINERENV_PATH" not in env and "APPTAINERENV_HOME" not in env
    assert "s3cret" not in " ".join(plan.rank_host_argv())


def test_singularity_is_apptainer_under_its_own_name() -> None:
    plan = plan_of("container.runtime=singularity", "container.image=/img/m.sif")
    assert plan.rank_host_argv()[:2] == ["singularity", "exec"]
    assert plan.container is not None
    assert "SINGULARITYENV_WANDB_API_KEY" in plan.container.environment({"WANDB_API_KEY": "k"})


def test_podman_shares_the_nodes_pids_network_and_shm_and_passes_variables_by_name() -> None:
    plan = plan_of(
        "container.runtime=podman", "container.image=docker.io/me/mmdit:1", "container.env=[HF_TOKEN]"
    )
    argv = plan.rank_host_argv()
    assert argv[:3] == ["podman", "run", "--rm"]
    for flag in ("-i", "--pid=host", "--network=host", "--ipc=host", "--sig-proxy=false"):
        assert flag in argv
    volumes = [argv[i + 1] for i, a in enumerate(argv) if a == "-v"]
    assert volumes == MOUNTED
    passed = [argv[i + 1] for i, a in enumerate(argv) if a == "--env"]
    assert passed == [
        "HPCLAUNCH_*", "NCCL_*", "TORCH_*", "GLOO_*", "CUDA_VISIBLE_DEVICES",
        "HF_TOKEN", "OMP_NUM_THREADS", "WANDB_API_KEY", "WANDB_MODE",
    ]  # fmt: skip
    assert argv[-5:] == ["docker.io/me/mmdit:1", "python3", *LAUNCHER]
    rootfs = plan_of("container.runtime=podman", "container.image=/img/rootfs").rank_host_argv()
    assert rootfs[-6:-4] == ["--rootfs", "/img/rootfs"]


def test_pyxis_starts_a_one_task_step_on_the_agents_own_node() -> None:
    plan = plan_of(
        "scheduler.kind=slurm",
        "container.runtime=pyxis",
        "container.image=nvcr.io#nvidia/pytorch:24.05-py3",
        "container.mounts=[/scratch:/scratch:ro]",
    )
    argv = plan.rank_host_argv(node="n7")
    assert argv[:6] == [
        "srun",
        "--overlap",
        "--nodes=1",
        "--ntasks=1",
        "--nodelist=n7",
        "--kill-on-bad-exit=1",
    ]
    assert "--container-image=nvcr.io#nvidia/pytorch:24.05-py3" in argv
    assert f"--container-mounts={','.join(['/scratch:/scratch:ro', *MOUNTED])}" in argv  # parents first
    assert "--container-env=OMP_NUM_THREADS,WANDB_API_KEY,WANDB_MODE" in argv
    assert "--container-workdir=/runs/x" in argv and argv[-4:] == ["python3", *LAUNCHER]
    assert plan.container is not None and not plan.container.runs_outside_an_allocation


def test_pyxis_names_every_variable_the_node_decided_so_the_images_env_never_wins() -> None:
    """Issue 49, L4: enroot starts from the image's ENV (NGC images set NCCL_ and TORCH_ variables),
    and only the names in --container-env take the node's value: the NCCL preset, the attempt's
    HPCLAUNCH_ variables and the node's CUDA_VISIBLE_DEVICES were the image's."""
    plan = plan_of(
        "scheduler.kind=slurm", "container.runtime=pyxis", "container.image=nvcr.io#nvidia/pytorch:24.05-py3"
    )
    node_env = {
        "NCCL_IB_HCA": "mlx5",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "HPCLAUNCH_RUN_DIR": "/runs/x",
        "CUDA_VISIBLE_DEVICES": "0,1",
        "PATH": "/usr/bin",
        "WANDB_MODE": "offline",
    }
    argv = plan.rank_host_argv(node="n7", node_dir="/tmp/hpclaunch-1000", env=node_env)
    (passed,) = [a.removeprefix("--container-env=") for a in argv if a.startswith("--container-env=")]
    assert passed.split(",") == [
        "CUDA_VISIBLE_DEVICES", "HPCLAUNCH_RUN_DIR", "NCCL_IB_HCA", "OMP_NUM_THREADS",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING", "WANDB_API_KEY", "WANDB_MODE",
    ]  # fmt: skip
    assert "PATH" not in passed.split(",") and "mlx5" not in " ".join(argv)  # names, never values
    mounts = next(a for a in argv if a.startswith("--container-mounts="))
    assert mounts.endswith(",/tmp/hpclaunch-1000:/tmp/hpclaunch-1000")


@pytest.mark.parametrize("runtime", ["pyxis", "apptainer", "podman", "charliecloud"])
def test_every_runtime_mounts_the_node_directory_at_tmp_under_its_name(runtime: str) -> None:
    """Issue 49, H1: the ranks' heartbeats and the compile cache live in this user's node-local
    directory, which the image's own /tmp (enroot's and podman's tmpfs, ch-run's $TMPDIR or
    --private-tmp, Apptainer's --contain) does not hold: every runtime's line mounts it."""
    extra = ["scheduler.kind=slurm"] if runtime == "pyxis" else []
    plan = plan_of(*extra, f"container.runtime={runtime}", "container.image=/img/m")
    argv = plan.rank_host_argv(node="n1", node_dir="/scratch/job7/hpclaunch-1000-x1y2")
    spec = "/scratch/job7/hpclaunch-1000-x1y2:/tmp/hpclaunch-1000-x1y2"
    assert spec in argv or f"--container-mounts={','.join([*SAME, spec])}" in argv, argv
    assert plan.rank_host_argv(node="n1", node_dir=None) != argv  # (the probe without one)


def test_mounts_inside_another_are_not_mounted_twice() -> None:
    plan = plan_of(
        "container.runtime=charliecloud",
        "container.image=/img",
        "data.token_dir=/runs/x/data/tok",  # inside the run directory
        "container.mounts=[/data, /data/lat:/elsewhere, /ro:/ro:ro, /ro/sub]",
    )
    assert plan.container is not None
    specs = {m.spec() for m in plan.container.mounts}
    assert specs == {
        "/data:/data",
        "/runs/x:/runs/x",
        "/data/lat:/elsewhere",
        "/ro:/ro:ro",
        "/ro/sub:/ro/sub",
    }
    # the data directories inside /data and the run directory are covered; a writable directory
    # inside a read-only mount is mounted again (writable)
    assert Mount.parse("/a:/b:ro") == Mount(src="/a", dst="/b", readonly=True)


def test_the_charliecloud_runtime_gets_a_user_name() -> None:
    container = plan_of("container.runtime=charliecloud", "container.image=/img").container
    assert container is not None
    assert container.environment({})["USER"]
    assert container.environment({"USER": "me"})["USER"] == "me"


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            ["container.runtime=podman"],
            "container.image: is missing: container.runtime podman needs the image",
        ),
        (["container.image=/x.sif"], "container.runtime: is none but container.image is set"),
        (["container.runtime=pyxis", "container.image=x"], "container.runtime: pyxis is a SLURM plugin"),
        (["container.runtime=podman", "container.image=x", "container.mounts=[data]"], "is not a mount"),
        (["container.runtime=podman", "container.image=x", "container.mounts=['/a,/b']"], "is not a mount"),
        (["container.runtime=podman", "container.image=x", "container.env=[A=1]"], "is not a variable name"),
        (["container.runtime=podman", "container.image=x", "container.workdir=w"], "is not an absolute path"),
        (
            ["container.runtime=podman", "container.image=x", "run_dir=/r:1"],
            "run_dir: '/r:1' cannot be mounted",
        ),
        (["container.runtime=docker"], "container.runtime: Input should be"),
        (
            ["container.runtime=podman", "container.image=x", "container.python=py thon"],
            "is not one executable",
        ),
    ],
)
def test_bad_container_input_names_the_key(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(None, ["run_dir=/runs/x", *overrides])
    assert message in e.value.one_line()


def test_a_null_runtime_is_none() -> None:
    cfg = load_config(None, ["container.runtime=null"])
    assert cfg.container.runtime == "none" and ContainerPlan.from_config(cfg) is None


def test_the_rendered_line_is_the_agents_command_quoted_by_the_one_function(tmp_path: Path) -> None:
    """A run directory a shell would misread: the comment line reads back as exactly the argv."""
    weird = tmp_path / "a'; touch pwned; echo 'b $(x)"
    cfg = load_config(
        None,
        [f"run_dir={weird}", "container.runtime=charliecloud", "container.image=/img", "launch.python=/p"],
        base=tmp_path,
    )
    prepared = prepare(cfg)
    line = next(x for x in prepared.rendered.text.splitlines() if x.startswith("#   ch-run"))
    assert shlex.split(line.removeprefix("#   ")) == prepared.plan.rank_host_argv()
