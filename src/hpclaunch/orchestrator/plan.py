"""JobPlan: the resolved, validated run. Pure: no I/O, no environment lookups.

Every number that appears in a job script, the torchrun command line or the job environment comes
from here, once. Renderers only format the plan; the node agent only fills in what can be known
inside the allocation (head address, node rank, job id).
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict

from .. import __version__
from ..config import RunConfig

AGENT_MODULE = "hpclaunch.jobs.agent"
TRAINER_MODULE = "hpclaunch.trainer"


class TorchrunPlan(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    nnodes: int
    nproc_per_node: int
    rdzv_port: int
    max_restarts: int = 0
    shutdown_timeout_s: int = 60

    @property
    def standalone(self) -> bool:
        return self.nnodes == 1


class SweepPoint(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    index: int
    name: str
    run_dir: str
    overrides: list[str]


class JobPlan(BaseModel):
    """What will run, where, with which resources. Saved as RUN/plan.json."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    run_dir: str
    scheduler: Literal["local", "slurm", "pbs"]
    nodes: int
    procs_per_node: int
    world_size: int
    gpus_per_node: int
    cpus_per_task: int
    mem_gb: float | None
    time_limit_s: int
    partition: str | None
    account: str | None
    qos: str | None
    constraint: str | None
    exclude: list[str]
    extra_directives: list[str]
    setup: list[str]
    pbs_dialect: Literal["pro", "torque"]
    pbs_launcher: Literal["mpiexec", "pbsdsh"]
    python: str
    env: dict[str, str]
    pass_env: list[str]
    nccl_preset: str
    warn_lead_s: int
    stop_lead_s: int | None
    max_requeues: int
    max_failure_retries: int
    kill_wait_s: int
    torchrun: TorchrunPlan
    backend: Literal["nccl", "gloo"]
    config_hash: str
    hpclaunch_version: str
    sweep: list[SweepPoint] = []
    array_parallelism: int | None = None

    # ---- derived, formatted once ---------------------------------------------------------------

    @property
    def time_limit_minutes(self) -> int:
        """SLURM counts whole minutes; round up so the run never gets less than asked."""
        return max(1, math.ceil(self.time_limit_s / 60))

    def agent_argv(self, run_dir: str | None = None) -> list[str]:
        """The command one node agent runs (``python -m hpclaunch.jobs.agent RUN_DIR``)."""
        return [self.python, "-u", "-m", AGENT_MODULE, run_dir or self.run_dir]

    def torchrun_argv(
        self, *, run_dir: str, node_rank: int, job_id: str, head_addr: str | None, local_addr: str | None
    ) -> list[str]:
        """The torchrun command for one node; multi-node uses c10d on the head's address."""
        t = self.torchrun
        argv = [self.python, "-m", "torch.distributed.run"]
        if t.standalone:
            argv += ["--standalone", "--nnodes=1"]
        else:
            if not head_addr:
                raise ValueError("a multi-node launch needs the head node's address")
            argv += [
                f"--nnodes={t.nnodes}",
                f"--node-rank={node_rank}",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint={head_addr}:{t.rdzv_port}",
                f"--rdzv-id={job_id}",
                # Who hosts the c10d store is decided here, not by hostname matching, which fails when
                # nodes share a hostname or resolve it to loopback (reference/local-slurm.md §8).
                f"--rdzv-conf=is_host={1 if node_rank == 0 else 0}",
            ]
            if local_addr:
                argv.append(f"--local-addr={local_addr}")
        argv += [
            f"--nproc-per-node={t.nproc_per_node}",
            f"--max-restarts={t.max_restarts}",
            "--module",
            TRAINER_MODULE,
            run_dir,
        ]
        return argv


def warn_lead_seconds(cfg: RunConfig) -> int:
    """How long before the end the scheduler warns (SLURM --signal). At least the stop lead time."""
    if cfg.launch.stop_lead_s is not None:
        return cfg.launch.stop_lead_s
    return int(min(300, max(5, cfg.scheduler.time_limit_s // 5)))


def default_threads(cfg: RunConfig) -> int:
    return max(1, cfg.scheduler.cpus_per_task // max(1, cfg.scheduler.nprocs))


def build(cfg: RunConfig, *, python: str, nccl_env: dict[str, str] | None = None) -> JobPlan:
    """The plan for a resolved config (absolute paths). ``python``: the job's interpreter.

    ``nccl_env``: variables of an explicitly named NCCL preset merged with ``nccl.env`` (the
    ``auto`` preset is resolved on each node by the agent, so it contributes nothing here).
    """
    s = cfg.scheduler
    env: dict[str, str] = {"OMP_NUM_THREADS": str(default_threads(cfg))}
    env.update(nccl_env if nccl_env is not None else dict(cfg.nccl.env))
    env.update(cfg.launch.env)
    launcher = (
        s.pbs_launcher if s.pbs_launcher != "auto" else ("mpiexec" if s.pbs_dialect == "pro" else "pbsdsh")
    )
    return JobPlan(
        name=cfg.name,
        run_dir=str(cfg.run_path()),
        scheduler=s.kind,
        nodes=s.nodes,
        procs_per_node=s.nprocs,
        world_size=s.world_size,
        gpus_per_node=s.gpus_per_node,
        cpus_per_task=s.cpus_per_task,
        mem_gb=s.mem_gb,
        time_limit_s=s.time_limit_s,
        partition=s.partition,
        account=s.account,
        qos=s.qos,
        constraint=s.constraint,
        exclude=list(s.exclude),
        extra_directives=list(s.extra_directives),
        setup=list(s.setup),
        pbs_dialect=s.pbs_dialect,
        pbs_launcher=launcher,
        python=cfg.launch.python or python,
        env=env,
        pass_env=list(cfg.launch.pass_env),
        nccl_preset=cfg.nccl.preset,
        warn_lead_s=warn_lead_seconds(cfg),
        stop_lead_s=cfg.launch.stop_lead_s,
        max_requeues=s.max_requeues,
        max_failure_retries=s.max_failure_retries,
        kill_wait_s=s.kill_wait_s,
        torchrun=TorchrunPlan(
            nnodes=s.nodes,
            nproc_per_node=s.nprocs,
            rdzv_port=cfg.launch.rdzv_port,
            shutdown_timeout_s=cfg.launch.shutdown_timeout_s,
        ),
        backend=cfg.backend,
        config_hash=cfg.config_hash(),
        hpclaunch_version=__version__,
        array_parallelism=s.array_parallelism,
    )
