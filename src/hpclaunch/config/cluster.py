"""Where and how the job runs: the ``scheduler`` section (with its ``rescue`` job), ``launch`` (the
rendezvous, the backend, the environment) and ``nccl``."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, field_validator, model_validator

from .keys import _RENAMED_IN_SCHEDULER
from .section_base import (
    ENV_NAME_RE,
    KeyedValueError,
    _check_directive_value,
    _Section,
    format_hms,
    parse_duration,
)


def _scalars_to_str(v: Any) -> Any:
    """YAML reads ``OMP_NUM_THREADS: 4`` as an int; environment values are strings."""
    if isinstance(v, dict):
        return {
            k: (str(x).lower() if isinstance(x, bool) else str(x)) if isinstance(x, (int, float, bool)) else x
            for k, x in v.items()
        }
    return v


# An ``env`` mapping as YAML gives it, its numbers and booleans made the strings an environment holds.
EnvValues = Annotated[dict[str, str], BeforeValidator(_scalars_to_str)]


class RescueConfig(_Section):
    """The small job left held on each SLURM/PBS job (``afternotok``): it starts only when the job ends
    failed with its attempt undecided (its batch host died), and continues the run without that node."""

    enabled: bool = Field(
        True,
        description="Leave a rescue job held on each SLURM/PBS job; false = none (a batch host's death "
        "then strands the run until submit --resume). While held it counts against the user's job limits.",
    )
    partition: str | None = Field(
        None, description="Partition / PBS queue of the rescue job; null = scheduler.partition."
    )
    qos: str | None = Field(None, description="SLURM QOS of the rescue job; null = scheduler.qos.")
    gpus: int | None = Field(
        None,
        ge=0,
        le=64,
        description="GPUs the rescue job asks for (it uses none, but some GPU partitions refuse jobs "
        "without); null = 1 in the run's own partition when the run has GPUs, else 0.",
    )

    @field_validator("partition", "qos")
    @classmethod
    def _directive_safe(cls, v: str | None, info: Any) -> str | None:
        return _check_directive_value(v, f"scheduler.rescue.{info.field_name}")


class SchedulerConfig(_Section):
    kind: Literal["local", "slurm", "pbs"] = Field(
        "local", description="Where the job runs: the embedded local scheduler, SLURM or PBS."
    )
    nodes: int = Field(1, ge=1, le=4096, description="Number of nodes (one node agent each).")
    restart_in_place: bool = Field(
        True,
        description="Recover a crash, a hang or a lost node inside the allocation (its agents start the next "
        "attempt, a spare in a failed node's place); false = through the scheduler (requeue, continuation job).",
    )
    spare_nodes: int = Field(
        0,
        ge=0,
        le=1024,
        description="Hot spares: the job asks for nodes + spare_nodes; the spares' agents wait and one takes "
        "the place of a node that fails, hangs or dies, in place (same world size, no requeue).",
    )
    gpus_per_node: int = Field(0, ge=0, le=64, description="GPUs per node; 0 = CPU ranks with gloo.")
    procs_per_node: int | None = Field(
        None,
        ge=1,
        le=256,
        description="Ranks per node (torchrun's --nproc-per-node); default gpus_per_node, or 1.",
    )
    cpus_per_node: int | Literal["all"] | None = Field(
        None,
        description="CPUs per node for its ranks, their loader workers and checkpoint writers (SLURM "
        "--cpus-per-task of the one task per node, PBS ncpus); null = ranks x (data.num_workers + 2); all = "
        "whole nodes (SLURM --exclusive, PBS place=excl). OMP_NUM_THREADS: a rank's share less its workers "
        "and writer. Formerly cpus_per_task.",
    )
    mem_gb: float | None = Field(
        None, gt=0, description="Memory per node in GB (at least 0.001: 1 MB); null = site default."
    )
    time_limit: str = Field(
        "01:00:00", description="Wall time per attempt: HH:MM:SS, D-HH:MM:SS, or 90s / 30m / 2h."
    )
    partition: str | None = Field(None, description="SLURM partition / PBS queue.")
    account: str | None = Field(None, description="Account to charge.")
    qos: str | None = Field(None, description="SLURM QOS.")
    constraint: str | None = Field(None, description="SLURM --constraint (node features).")
    exclude: list[str] = Field(default_factory=list, description="Node names never to use.")
    extra_directives: list[str] = Field(
        default_factory=list,
        description="Raw '#SBATCH ...' / '#PBS ...' lines added to the script (checked by the lint).",
    )
    setup: list[str] = Field(
        default_factory=list,
        description="Shell lines run before launch, one command each (module load, conda activate).",
    )
    pbs_dialect: Literal["pro", "torque"] = Field(
        "pro", description="PBS flavour: pro (PBS Pro/OpenPBS select=) or torque (nodes=:ppn=)."
    )
    pbs_launcher: Literal["auto", "mpiexec", "pbsdsh"] = Field(
        "auto",
        description="How a multi-node PBS job starts one agent per node: mpiexec -n N --ppn 1 (an MPICH-style "
        "mpiexec: MPICH/Hydra, Intel MPI, Cray's; OpenMPI's has no --ppn) or pbsdsh (any site; OpenMPI sites "
        "use this); auto = mpiexec (pro) / pbsdsh (torque).",
    )
    max_requeues: int = Field(
        20, ge=0, le=10000, description="Requeues allowed for timeout, preemption and user stops."
    )
    max_failure_retries: int = Field(
        1, ge=0, le=100, description="Restarts allowed after a crash (Python error, NCCL failure)."
    )
    kill_wait_s: int = Field(
        30,
        ge=1,
        le=3600,
        description="Local scheduler: seconds between SIGTERM at the limit and SIGKILL.",
    )
    array_parallelism: int | None = Field(
        None, ge=1, description="Sweeps: at most this many points run at once (default all)."
    )
    max_hang_retries: int = Field(
        3,
        ge=0,
        le=100,
        description="Continuations allowed after the watchdog finds a hang (each from the last checkpoint).",
    )
    max_restarts_without_progress: int = Field(
        3,
        ge=1,
        le=100,
        description="Failures (crash, hang, node) continued in a row with no new checkpoint between "
        "them before the run stops as making no progress.",
    )
    gpu_hour_cost: float | None = Field(
        None,
        ge=0,
        description="Price of one GPU-hour: status and preflight then give the run's cost; null = GPU-hours only.",
    )
    rescue: RescueConfig = Field(default_factory=RescueConfig)  # type: ignore[arg-type]

    @model_validator(mode="before")
    @classmethod
    def _old_names(cls, data: Any) -> Any:
        """Keys renamed since a release are still read (configs and run directories written before)."""
        if not isinstance(data, dict):
            return data
        for old, new in _RENAMED_IN_SCHEDULER.items():
            if old in data:
                if new in data:
                    raise KeyedValueError(old, f"is the old name of scheduler.{new}; give only {new}")
                data = {(new if k == old else k): v for k, v in data.items()}
        return data

    @field_validator("cpus_per_node", mode="before")
    @classmethod
    def _cpus_count_all_or_null(cls, v: Any) -> Any:
        """One message for every wrong value (pydantic's would name each member of the union)."""
        if v is None or v == "all":
            return v
        text = str(v).strip()
        if isinstance(v, bool) or not (isinstance(v, int) or text.isdigit()) or not 1 <= int(text) <= 4096:
            raise ValueError(
                f"{v!r} is not a CPU count from 1 to 4096, all (whole nodes) or null (the ranks' need)"
            )
        return int(text)

    @field_validator("mem_gb")
    @classmethod
    def _at_least_a_megabyte(cls, v: float | None) -> float | None:
        """The script asks for whole MB (``mem_directive``): below 1 MB it would ask for 0, which
        SLURM reads as all of the node's memory."""
        if v is not None and int(v * 1024) < 1:
            raise ValueError(
                f"{v} GB is less than 1 MB, the least a job script can ask for (0 MB is all of the node's "
                "memory to SLURM); give at least 0.001, or null for the site's default"
            )
        return v

    @field_validator("time_limit", mode="before")
    @classmethod
    def _time_limit_has_a_unit(cls, v: Any) -> Any:
        """YAML reads ``time_limit: 90`` as a number: say what it lacks, not "should be a string"."""
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            raise ValueError(
                f"{v} has no unit; use HH:MM:SS, D-HH:MM:SS or a number with s, m, h or d (did you mean "
                f"'{v}m', {format_hms(round(v * 60))}?)"
            )
        return v

    @field_validator("time_limit")
    @classmethod
    def _time_limit_parses(cls, v: str) -> str:
        if parse_duration(v) < 10:
            raise ValueError(f"{v!r} is shorter than 10 seconds")
        return v

    @field_validator("partition", "account", "qos", "constraint")
    @classmethod
    def _directive_safe(cls, v: str | None, info: Any) -> str | None:
        return _check_directive_value(v, f"scheduler.{info.field_name}")

    @field_validator("exclude")
    @classmethod
    def _nodes_safe(cls, v: list[str]) -> list[str]:
        for node in v:
            _check_directive_value(node, "scheduler.exclude")
        return v

    @field_validator("setup", "extra_directives")
    @classmethod
    def _one_line_each(cls, v: list[str], info: Any) -> list[str]:
        for i, line in enumerate(v):
            if "\n" in line or "\r" in line:
                raise ValueError(f"entry {i} spans several lines; give one line per entry")
        return v

    @property
    def time_limit_s(self) -> int:
        return parse_duration(self.time_limit)

    @property
    def nprocs(self) -> int:
        """Processes (ranks) per node."""
        if self.procs_per_node is not None:
            return self.procs_per_node
        return self.gpus_per_node or 1

    @property
    def world_size(self) -> int:
        return self.nodes * self.nprocs

    @model_validator(mode="after")
    def _cross_fields(self) -> SchedulerConfig:
        if self.gpus_per_node and self.procs_per_node and self.procs_per_node > self.gpus_per_node:
            raise KeyedValueError(
                "procs_per_node",
                f"{self.procs_per_node} is more than gpus_per_node={self.gpus_per_node}; "
                "one rank per GPU at most",
                related=("gpus_per_node",),
            )
        if self.kind == "local" and self.nodes != 1:
            raise KeyedValueError(
                "nodes", "the local scheduler runs one node; set nodes: 1 or kind: slurm/pbs"
            )
        if self.kind == "local" and self.spare_nodes:
            raise KeyedValueError(
                "spare_nodes", "the local scheduler runs one node and has no spares; use kind: slurm/pbs"
            )
        if self.cpus_per_node == "all" and self.kind == "pbs" and self.pbs_dialect == "torque":
            raise KeyedValueError(
                "cpus_per_node",
                "all asks for whole nodes, which the Torque dialect cannot; give the nodes' CPU count",
                related=("pbs_dialect",),
            )
        if self.kind != "pbs":
            for key in ("pbs_dialect", "pbs_launcher"):
                if (
                    key in self.model_fields_set
                    and getattr(self, key) != type(self).model_fields[key].default
                ):
                    raise KeyedValueError(key, f"only applies to kind: pbs (kind is {self.kind})")
        return self


class LaunchConfig(_Section):
    rdzv_port: int | None = Field(
        None,
        ge=1024,
        le=65535,
        description="c10d rendezvous port on the head node; null = chosen per job from its id (20000-32767), "
        "so two jobs (or sweep points) sharing a head node do not collide.",
    )
    backend: Literal["auto", "nccl", "gloo"] = Field(
        "auto", description="torch.distributed backend; auto = nccl with GPUs, gloo without."
    )
    stop_lead_s: int | None = Field(
        None,
        ge=5,
        description="Seconds before the end to stop and save; null = measured checkpoint time + margin.",
    )
    stop_margin_s: int = Field(
        10,
        ge=0,
        description="Safety margin added to the measured checkpoint time for the deadline.",
    )
    python: str | None = Field(
        None, description="Python executable in the job; null = the one running hpclaunch."
    )
    env: EnvValues = Field(
        default_factory=dict,
        description="Extra environment variables (not secrets: they are written into the script).",
    )
    pass_env: list[str] = Field(
        default_factory=list,
        description="Names of variables (secrets) passed from the submitting shell; values are never written.",
    )

    @field_validator("env")
    @classmethod
    def _env_names(cls, v: dict[str, str]) -> dict[str, str]:
        for name, value in v.items():
            if not ENV_NAME_RE.fullmatch(name):
                raise ValueError(f"{name!r} is not a valid environment variable name")
            if not isinstance(value, str):
                raise ValueError(f"{name}: value must be a string")
        return v

    @field_validator("pass_env")
    @classmethod
    def _pass_env_names(cls, v: list[str]) -> list[str]:
        for name in v:
            if not ENV_NAME_RE.fullmatch(name):
                raise ValueError(f"{name!r} is not a valid environment variable name")
        return v


NcclPreset = Literal["auto", "ib", "roce", "ethernet", "nvlink", "efa", "debug", "none"]


class NcclConfig(_Section):
    preset: NcclPreset = Field(
        "auto", description="Named NCCL preset; auto = chosen on each node from what it shows."
    )
    env: EnvValues = Field(
        default_factory=dict,
        description="Extra or overriding NCCL_* / TORCH_NCCL_* variables (validated).",
    )

    @field_validator("env")
    @classmethod
    def _nccl_values_known(cls, v: dict[str, str]) -> dict[str, str]:
        # Certain mistakes only (removed/non-existent variables, values NCCL silently ignores);
        # doubtful settings are reported as warnings by `hpclaunch preflight`.
        from ..nccl import validate_nccl_env

        errors = [issue for issue in validate_nccl_env(v) if issue.severity == "error"]
        if errors:
            raise ValueError(str(errors[0]))
        return v
