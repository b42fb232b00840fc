"""``build``: a resolved config -> the JobPlan (``rundir.plan``). Pure: no I/O, no environment lookups."""

from __future__ import annotations

from .. import __version__
from ..config import RunConfig
from ..preflight.sizes import planned_save_s
from ..rundir.container import ContainerPlan
from ..rundir.plan import AgentPlan, JobPlan, RescuePlan

# The scheduler settings (and the values it derives: time_limit_s, world_size) that the plan
# carries unchanged under the same names; ``build`` names the rest (its lists are copies).
SCHEDULER_AS_IS = (
    "nodes",
    "spare_nodes",
    "restart_in_place",
    "world_size",
    "gpus_per_node",
    "mem_gb",
    "time_limit_s",
    "partition",
    "account",
    "qos",
    "constraint",
    "pbs_dialect",
    "max_requeues",
    "max_failure_retries",
    "max_hang_retries",
    "max_restarts_without_progress",
    "kill_wait_s",
    "array_parallelism",
)


def warn_lead_seconds(cfg: RunConfig) -> int:
    """How long before the end the scheduler warns (SLURM --signal). At least the stop lead time."""
    if cfg.launch.stop_lead_s is not None:
        return cfg.launch.stop_lead_s
    return int(min(300, max(5, cfg.scheduler.time_limit_s // 5)))


def build(cfg: RunConfig, *, python: str, nccl_env: dict[str, str] | None = None) -> JobPlan:
    """The plan for a resolved config (absolute paths). ``python``: the job's interpreter.

    ``nccl_env``: variables of an explicitly named NCCL preset merged with ``nccl.env`` (the
    ``auto`` preset is resolved on each node by the agent, so it contributes nothing here).
    """
    s = cfg.scheduler
    # Each rank's OpenMP threads: its share of the node's CPUs less its loader workers and writer
    # (``cpus_per_node: all``: counted by the script on the node, ``templates.shell.omp_line``).
    threads = cfg.omp_threads
    env: dict[str, str] = {} if threads is None else {"OMP_NUM_THREADS": str(threads)}
    env.update(nccl_env if nccl_env is not None else dict(cfg.nccl.env))
    env.update(cfg.launch.env)
    launcher = (
        s.pbs_launcher if s.pbs_launcher != "auto" else ("mpiexec" if s.pbs_dialect == "pro" else "pbsdsh")
    )
    return JobPlan(
        **{key: getattr(s, key) for key in SCHEDULER_AS_IS},
        name=cfg.name,
        run_dir=str(cfg.run_path()),
        checkpoint_dir=cfg.checkpoint.dir,
        scheduler=s.kind,
        procs_per_node=s.nprocs,
        cpus_per_task=cfg.cpus_per_node,
        whole_node=s.cpus_per_node == "all",
        helpers_per_rank=cfg.helpers_per_rank,
        exclude=list(s.exclude),
        extra_directives=list(s.extra_directives),
        setup=list(s.setup),
        pbs_launcher=launcher,
        python=cfg.launch.python or python,
        env=env,
        pass_env=list(cfg.launch.pass_env),
        nccl_preset=cfg.nccl.preset,
        warn_lead_s=warn_lead_seconds(cfg),
        stop_lead_s=cfg.launch.stop_lead_s,
        stop_margin_s=cfg.launch.stop_margin_s,
        save_estimate_s=planned_save_s(cfg),
        max_node_excludes=cfg.preflight.max_node_excludes,
        backend=cfg.backend,
        config_hash=cfg.config_hash(),
        hpclaunch_version=__version__,
        container=ContainerPlan.from_config(cfg, env_names=list(env)),
        rescue=rescue_plan(cfg),
        agent=AgentPlan.from_config(cfg),
    )


def rescue_plan(cfg: RunConfig) -> RescuePlan:
    """Where the rescue job runs: its own partition and QOS, else the run's; GPUs only where it
    shares the run's GPU partition (which may refuse a job without any), unless said."""
    s, r = cfg.scheduler, cfg.scheduler.rescue
    partition = r.partition or s.partition
    gpus = r.gpus if r.gpus is not None else (1 if s.gpus_per_node and partition == s.partition else 0)
    return RescuePlan(enabled=r.enabled, partition=partition, qos=r.qos or s.qos, gpus=gpus)
