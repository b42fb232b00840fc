"""The JobPlan model: the resolved, validated run, as saved in ``RUN/plan.json``.

Every number that appears in a job script, the node agent's command line or the job environment
comes from here, once. ``orchestrator.plan_build.build`` makes it on the login side; renderers only format it;
the node agent reads it back and only fills in what can be known inside the allocation (head
address, node rank, job id).

On the node the plan is the agent's one source (``AgentPlan``: what it needs of the config, taken at
submit); ``config.yaml`` is the ranks' (what they train) and what the node checks evaluate, as
preflight does on the login side.
"""

from __future__ import annotations

import contextlib
import json
import zlib
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..config import MemoryTierConfig, RunConfig, TestingConfig, WatchdogConfig
from ..errors import HpclaunchError
from ..fsutil import atomic_write_json
from .clock import AttemptClock, applied_limit_s, stop_lead_s, whole_minutes
from .container import NODE, NODE_DIR, ContainerPlan
from .paths import RunPaths
from .readers import read_config

AGENT_MODULE = "hpclaunch.jobs.agent"
LAUNCHER_MODULE = "hpclaunch.rank.host"  # the rank host (started by the agent, by module name)


# Keys that plans written by an older version hold and this one reads past: ``torchrun`` (the
# counts the plan states anyway, and the rendezvous port that ``launch.rdzv_port`` states).
RETIRED_KEYS = ("torchrun",)

# Where per-job rendezvous ports come from: below Linux's ephemeral range (32768-60999), so a port
# derived for one job is never an outgoing connection's port on the same host.
RDZV_PORT_BASE, RDZV_PORT_SPAN = 20000, 12768


def rdzv_port_for(attempt: str, fixed: int | None) -> int:
    """The rendezvous port of ``attempt`` (its key, ``NodeContext.attempt``): ``launch.rdzv_port``
    when set, else derived from the key (every node of the attempt derives the same one; jobs sharing
    a head node, and an attempt restarted in place beside its predecessor's store, get different
    ones). The one rule: the ranks' rendezvous (``jobs.attempt_env``) and the node checks'
    (``preflight.network``) both ask it."""
    if fixed is not None:
        return fixed
    return RDZV_PORT_BASE + zlib.crc32(attempt.encode()) % RDZV_PORT_SPAN


class SweepPoint(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    index: int
    name: str
    run_dir: str
    overrides: list[str]


class RescuePlan(BaseModel):
    """The rescue job (``scheduler.rescue``, resolved): whether there is one, where, with what."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = True
    partition: str | None = None
    qos: str | None = None
    gpus: int = 0


class AgentPlan(BaseModel):
    """What the node agent needs of the run's config, taken from it once at submit: with it the agent
    reads the plan alone. A plan written before it existed gets it from the run's ``config.yaml``
    when read (``read_plan``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    program: Literal["mmdit", "script"] = "mmdit"  # what the ranks run (``script.path`` set: the user's)
    script_preload: list[str] = []  # script.preload: the script's slow imports, made once per node
    compile: bool = False  # train.compile: the rank host imports the compiler once too
    rdzv_port: int | None = None  # launch.rdzv_port (None: derived per attempt, ``rdzv_port_for``)
    node_checks: bool = True  # preflight.node_checks
    smoke_timeout_s: int = 60  # preflight.smoke_timeout_s (also the window of a start-up hang)
    watchdog: WatchdogConfig = Field(default_factory=WatchdogConfig)  # type: ignore[arg-type]
    # checkpoint.memory, and the testing knobs the agent acts on (a failed node check, a pause)
    memory: MemoryTierConfig = Field(default_factory=MemoryTierConfig)  # type: ignore[arg-type]
    testing: TestingConfig = Field(default_factory=TestingConfig)  # type: ignore[arg-type]

    @classmethod
    def from_config(cls, cfg: RunConfig) -> AgentPlan:
        return cls(
            program="script" if cfg.is_script else "mmdit",
            script_preload=list(cfg.script.preload),
            compile=cfg.train.compile,
            rdzv_port=cfg.launch.rdzv_port,
            node_checks=cfg.preflight.node_checks,
            smoke_timeout_s=cfg.preflight.smoke_timeout_s,
            watchdog=cfg.watchdog,
            memory=cfg.checkpoint.memory,
            testing=cfg.testing,
        )


class JobPlan(BaseModel):
    """What will run, where, with which resources. Saved as RUN/plan.json."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    run_dir: str
    checkpoint_dir: str | None = None  # checkpoint.dir when set (absolute), else RUN/checkpoints
    scheduler: Literal["local", "slurm", "pbs"]
    nodes: int  # that train
    spare_nodes: int = 0  # hot spares the job holds besides them (scheduler.spare_nodes)
    restart_in_place: bool = True  # scheduler.restart_in_place
    procs_per_node: int
    world_size: int
    gpus_per_node: int
    cpus_per_task: int  # CPUs per node (one task per node): scheduler.cpus_per_node, or its default
    # cpus_per_node: all: the job asks for whole nodes (SLURM --exclusive, PBS place=excl) and the
    # script counts each rank's OpenMP threads from the node's CPUs (less ``helpers_per_rank``).
    whole_node: bool = False
    helpers_per_rank: int = 2  # a rank's loader workers and its checkpoint writer
    mem_gb: float | None
    time_limit_s: int
    partition: str | None
    account: str | None
    qos: str | None
    constraint: str | None
    exclude: list[str]
    # The nodes the job must run on, one each. Set by a continuation that avoids failed nodes where
    # the scheduler can name hosts but not exclude them (PBS Pro: one select chunk per host).
    hosts: list[str] = []
    extra_directives: list[str]
    setup: list[str]
    pbs_dialect: Literal["pro", "torque"]
    pbs_launcher: Literal["mpiexec", "pbsdsh"]
    python: str
    env: dict[str, str]
    pass_env: list[str]
    nccl_preset: str
    warn_lead_s: int  # when before the end the scheduler warns (SLURM --signal, the local USR2)
    stop_lead_s: int | None  # launch.stop_lead_s; None = the clock's rule (rundir.clock)
    stop_margin_s: int = 10  # launch.stop_margin_s
    save_estimate_s: float = 5.0  # one save, estimated from the model's size, until one is measured
    # Every retry budget, from one place (plans written before the last two existed: defaults).
    max_requeues: int
    max_failure_retries: int
    max_hang_retries: int = 3
    max_node_excludes: int = 2
    max_restarts_without_progress: int = 3
    kill_wait_s: int
    backend: Literal["nccl", "gloo"]
    config_hash: str
    hpclaunch_version: str
    sweep: list[SweepPoint] = []
    array_parallelism: int | None = None
    container: ContainerPlan | None = None  # the image the rank host and the ranks run in
    rescue: RescuePlan = RescuePlan()  # (plans written before it: the run's partition, no GPUs)
    agent: AgentPlan = AgentPlan()  # (plans written before it: ``read_plan``)

    @model_validator(mode="before")
    @classmethod
    def _drop_retired(cls, data: Any) -> Any:
        """An older version's plan stays readable: its retired keys (``RETIRED_KEYS``) are dropped."""
        if isinstance(data, dict) and any(k in data for k in RETIRED_KEYS):
            return {k: v for k, v in data.items() if k not in RETIRED_KEYS}
        return data

    # ---- derived, formatted once ---------------------------------------------------------------

    @property
    def allocation_nodes(self) -> int:
        """Nodes the job asks the scheduler for: the training nodes and the hot spares."""
        return self.nodes + self.spare_nodes

    @property
    def planned_stop_lead_s(self) -> float:
        """The stop lead before any save of this run was measured (``rundir.clock``'s one rule with
        the plan's save estimate): what the script lint and preflight check, and what the trainer
        starts from before its measurements refine it."""
        return stop_lead_s(fixed_s=self.stop_lead_s, save_s=self.save_estimate_s, margin_s=self.stop_margin_s)

    def attempt_clock(
        self, *, start: float, scheduler_end: float | None, limit_s: float | None = None
    ) -> AttemptClock:
        """This plan's attempt clock, from the scheduler's facts (``limit_s``: the limit it applies,
        default the plan's)."""
        return AttemptClock.build(
            start=start,
            limit_s=self.time_limit_s if limit_s is None else limit_s,
            scheduler_end=scheduler_end,
            warn_lead_s=self.warn_lead_s,
            stop_lead_fixed_s=self.stop_lead_s,
            margin_s=self.stop_margin_s,
            save_estimate_s=self.save_estimate_s,
        )

    def paths(self, run_dir: str | None = None) -> RunPaths:
        """The run directory's paths (``run_dir``: a sweep point's, default this plan's)."""
        return RunPaths.of(run_dir or self.run_dir, self.checkpoint_dir)

    @property
    def time_limit_minutes(self) -> int:
        """SLURM counts whole minutes; round up so the run never gets less than asked."""
        return whole_minutes(self.time_limit_s)

    @property
    def applied_time_limit_s(self) -> float:
        """The limit this run's scheduler applies to each attempt (``rundir.clock.applied_limit_s``)."""
        return applied_limit_s(self.scheduler, self.time_limit_s)

    def agent_argv(self, run_dir: str | None = None) -> list[str]:
        """The command one node agent runs (``python -m hpclaunch.jobs.agent RUN_DIR``)."""
        return [self.python, "-u", "-m", AGENT_MODULE, run_dir or self.run_dir]

    def rank_host_argv(
        self, *, node: str = NODE, node_dir: str | None = NODE_DIR, env: Mapping[str, str] | None = None
    ) -> list[str]:
        """The command a node agent starts its rank host with: in the container's image when the run
        has one (``node``: this node's name, which pyxis's step names; ``node_dir``: this user's
        node-local directory there, mounted in the image; ``env``: the ranks' environment, whose
        names pass), else with the job's Python."""
        if self.container is None:
            return [self.python, "-u", "-m", LAUNCHER_MODULE]
        argv = [self.container.python, "-u", "-m", LAUNCHER_MODULE]
        return self.container.wrap(argv, node=node, node_dir=node_dir, env=env)


def read_plan(paths: RunPaths) -> JobPlan:
    """The plan saved in ``RUN/plan.json``; one written before the plan held the agent's part gets it
    from the run's ``config.yaml`` (the config it was made from; the defaults when there is none or
    it cannot be read: the node agent reads it again for its checks, and says why it cannot)."""
    data = json.loads(paths.plan.read_text())
    if isinstance(data, dict) and "agent" not in data:
        with contextlib.suppress(HpclaunchError, OSError):
            data["agent"] = AgentPlan.from_config(read_config(paths)).model_dump(mode="json")
    return JobPlan.model_validate(data)


def write_plan(paths: RunPaths, plan: JobPlan) -> None:
    """Save ``plan`` as ``RUN/plan.json`` (atomically: a reader sees the old plan or the new one)."""
    atomic_write_json(paths.plan, plan.model_dump(mode="json"))
