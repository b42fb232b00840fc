"""``build``: a resolved config -> the JobPlan (``rundir.plan``). Pure: no I/O, no environment lookups."""

from __future__ import annotations

from .. import __version__
from ..config import RunConfig
from ..preflight.sizes import planned_save_s
from ..rundir.container import ContainerPlan
from ..rundir.plan import JobPlan, TorchrunPlan


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
        checkpoint_dir=cfg.checkpoint.dir,
        scheduler=s.kind,
        nodes=s.nodes,
        spare_nodes=s.spare_nodes,
        restart_in_place=s.restart_in_place,
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
        stop_margin_s=cfg.launch.stop_margin_s,
        save_estimate_s=planned_save_s(cfg),
        max_requeues=s.max_requeues,
        max_failure_retries=s.max_failure_retries,
        max_hang_retries=s.max_hang_retries,
        max_restarts_without_progress=s.max_restarts_without_progress,
        max_node_excludes=cfg.preflight.max_node_excludes,
        kill_wait_s=s.kill_wait_s,
        torchrun=TorchrunPlan(
            nnodes=s.nodes,
            nproc_per_node=s.nprocs,
            rdzv_port=cfg.launch.rdzv_port,
        ),
        backend=cfg.backend,
        config_hash=cfg.config_hash(),
        hpclaunch_version=__version__,
        array_parallelism=s.array_parallelism,
        container=ContainerPlan.from_config(cfg, env_names=list(env)),
    )
