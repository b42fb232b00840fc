"""The one typed config tree: YAML file + ``--set dotted.key=value`` overrides -> ``RunConfig``.

Every field carries its help text and bounds; every error names the dotted key, the bad value and
what is allowed. Unknown keys get a did-you-mean. Cross-field rules live on the models. This module
never imports torch: every CLI command loads configs.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from .errors import ConfigError, did_you_mean

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
# Values that end up in #SBATCH/#PBS directive lines: no whitespace, quotes or shell syntax.
DIRECTIVE_VALUE_RE = re.compile(r"^[A-Za-z0-9._:@%+,=/-]+$")
ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_TIME_HMS = re.compile(r"^(?:(?P<d>\d+)-)?(?P<h>\d+):(?P<m>[0-5]?\d):(?P<s>[0-5]?\d)$")
_TIME_UNIT = re.compile(r"^(?P<n>\d+(?:\.\d+)?)(?P<u>[smhd])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> int:
    """Seconds in ``[D-]HH:MM:SS`` or ``<number><s|m|h|d>``; ValueError otherwise."""
    text = str(text).strip()
    if m := _TIME_HMS.match(text):
        d = int(m["d"] or 0)
        return ((d * 24 + int(m["h"])) * 60 + int(m["m"])) * 60 + int(m["s"])
    if m := _TIME_UNIT.match(text):
        return round(float(m["n"]) * _UNIT_S[m["u"]])
    raise ValueError(f"{text!r} is not a duration; use HH:MM:SS, D-HH:MM:SS or e.g. 90s, 30m, 2h")


def format_hms(seconds: int) -> str:
    """``HH:MM:SS`` (hours may exceed 24), the form both SLURM and PBS accept."""
    h, rest = divmod(int(seconds), 3600)
    m, s = divmod(rest, 60)
    return f"{h:02d}:{m:02d}:{s:02d}"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True, frozen=True)


class KeyedValueError(ValueError):
    """A cross-field error that names the dotted key (relative to the model raising it) and the
    other keys it depends on (``related``, same base): the error then names the layer that set any
    of them last (a ``--set train.steps=5`` against a file's warmup blames ``--set``)."""

    def __init__(self, key: str, message: str, *, related: tuple[str, ...] = ()):
        super().__init__(message)
        self.key = key
        self.related = related


def _check_directive_value(value: str | None, key: str) -> str | None:
    if value is not None and not DIRECTIVE_VALUE_RE.fullmatch(value):
        raise ValueError(
            f"{value!r} cannot go into a #SBATCH/#PBS line ({key} allows letters, digits and ._:@%+,=/-)"
        )
    return value


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


# Keys renamed since a release: the old name is read as the new one (``RENAMED_KEYS``: dotted).
_RENAMED_IN_SCHEDULER = {"cpus_per_task": "cpus_per_node"}
RENAMED_KEYS = {f"scheduler.{old}": f"scheduler.{new}" for old, new in _RENAMED_IN_SCHEDULER.items()}


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
    mem_gb: float | None = Field(None, gt=0, description="Memory per node in GB; null = site default.")
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
    env: dict[str, str] = Field(
        default_factory=dict,
        description="Extra environment variables (not secrets: they are written into the script).",
    )
    pass_env: list[str] = Field(
        default_factory=list,
        description="Names of variables (secrets) passed from the submitting shell; values are never written.",
    )

    @field_validator("env", mode="before")
    @classmethod
    def _env_scalars_to_str(cls, v: Any) -> Any:
        return _scalars_to_str(v)

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


def _scalars_to_str(v: Any) -> Any:
    """YAML reads ``OMP_NUM_THREADS: 4`` as an int; environment values are strings."""
    if isinstance(v, dict):
        return {
            k: (str(x).lower() if isinstance(x, bool) else str(x)) if isinstance(x, (int, float, bool)) else x
            for k, x in v.items()
        }
    return v


NcclPreset = Literal["auto", "ib", "roce", "ethernet", "nvlink", "efa", "debug", "none"]


class NcclConfig(_Section):
    preset: NcclPreset = Field(
        "auto", description="Named NCCL preset; auto = chosen on each node from what it shows."
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        description="Extra or overriding NCCL_* / TORCH_NCCL_* variables (validated).",
    )

    @field_validator("env", mode="before")
    @classmethod
    def _env_scalars_to_str(cls, v: Any) -> Any:
        return _scalars_to_str(v)

    @field_validator("env")
    @classmethod
    def _nccl_values_known(cls, v: dict[str, str]) -> dict[str, str]:
        # Certain mistakes only (removed/non-existent variables, values NCCL silently ignores);
        # doubtful settings are reported as warnings by `hpclaunch preflight`.
        from .nccl import validate_nccl_env

        errors = [issue for issue in validate_nccl_env(v) if issue.severity == "error"]
        if errors:
            raise ValueError(str(errors[0]))
        return v


class ModelConfig(_Section):
    vocab_size: int = Field(
        256, ge=4, le=1_000_000, description="Text vocabulary size (ids 0..vocab_size-1)."
    )
    text_len: int = Field(32, ge=1, le=65536, description="Tokens per sample.")
    latent_len: int = Field(8, ge=1, le=65536, description="Latent vectors per sample.")
    latent_dim: int = Field(16, ge=1, le=65536, description="Channels of one latent vector in the data.")
    depth: int = Field(2, ge=1, le=256, description="MMDiT blocks.")
    dim_text: int = Field(64, ge=8, description="Width of the text stream.")
    dim_latent: int = Field(64, ge=8, description="Width of the latent stream.")
    dim_cond: int = Field(64, ge=8, description="Width of the timestep embedding fed to time_cond.")
    heads: int = Field(4, ge=1, description="Attention heads.")
    dim_head: int = Field(16, ge=4, description="Width of one head.")
    num_residual_streams: int = Field(
        1, ge=1, le=8, description="mmdit hyper-connection streams; 1 = plain residual."
    )
    flash_attn: bool = Field(False, description="Use SDPA flash attention in the trunk.")


class DataConfig(_Section):
    token_dir: str = Field(
        "data/tiny/tokens", description="Directory of *.npz shards with input_ids [N, text_len]."
    )
    latent_dir: str = Field(
        "data/tiny/latents",
        description="Directory of *.npy shards [N, latent_len, latent_dim], paired by stem.",
    )
    val_token_dir: str | None = Field(
        None, description="Validation token shards (same format); null = none, or data.val_fraction."
    )
    val_latent_dir: str | None = Field(
        None, description="Validation latent shards, paired with data.val_token_dir by stem."
    )
    val_fraction: float = Field(
        0.0,
        ge=0,
        lt=0.5,
        description="Hold out this fraction of the training samples for validation (fixed by train.seed).",
    )
    pad_id: int | None = Field(
        None,
        ge=0,
        description="Token id that pads variable-length text (masked out of attention and loss); null = fixed-length text.",
    )
    num_workers: int = Field(
        1,
        ge=0,
        le=64,
        description="DataLoader worker processes per rank (raise it where cores are spare); 0 = read in the training process.",
    )
    prefetch_factor: int = Field(2, ge=1, le=64, description="Steps of data each worker prepares ahead.")


class WandbConfig(_Section):
    """Weights & Biases (the optional extra ``hpclaunch[wandb]``): one W&B run across every attempt."""

    project: str = Field("hpclaunch", description="W&B project.")
    entity: str | None = Field(None, description="W&B entity (team or user); null = the key's default.")
    name: str | None = Field(None, description="Display name of the W&B run; null = the run's name.")
    tags: list[str] = Field(default_factory=list, description="Tags of the W&B run.")
    mode: Literal["online", "offline", "disabled"] = Field(
        "online",
        description="online: stream to W&B (the key by name: launch.pass_env: [WANDB_API_KEY]); "
        "offline: write RUN/wandb/ for 'wandb sync'; disabled: nothing.",
    )

    @model_validator(mode="after")
    def _extra_installed(self) -> WandbConfig:
        if self.mode != "disabled" and extra_missing("wandb"):
            raise KeyedValueError(
                "mode",
                f"{self.mode} needs Weights & Biases, which is not installed: pip install 'hpclaunch[wandb]' "
                "(or set train.wandb.mode: disabled)",
            )
        return self


def extra_missing(module: str) -> bool:
    """Whether an optional extra's package cannot be imported here (found without importing it)."""
    import importlib.util

    try:
        return importlib.util.find_spec(module) is None
    except (ImportError, ValueError):
        return True


class ProfileKnob(_Section):
    """Steps to profile: ``torch.profiler`` from the start of step ``start`` for ``steps`` steps."""

    start: int = Field(10, ge=1, description="The first profiled step (after warm-up and compilation).")
    steps: int = Field(2, ge=1, le=50, description="Steps profiled.")
    trace: bool = Field(False, description="Also write a Chrome trace (rank0.trace.json.gz; large).")


class TrainConfig(_Section):
    seed: int = Field(0, ge=0, description="Seed of every random draw (init, order, masks, t, noise).")
    steps: int = Field(200, ge=1, description="Optimizer steps in the whole run.")
    global_batch: int = Field(16, ge=1, description="Samples per optimizer step across all ranks.")
    micro_batch: int | None = Field(
        None,
        ge=1,
        description="Samples per rank per forward pass; null = no gradient accumulation.",
    )
    lr: float = Field(3e-4, gt=0, le=10, description="Peak learning rate.")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Final LR as a fraction of lr (cosine).")
    warmup_steps: int = Field(
        10,
        ge=0,
        description="Linear warmup steps; left out: 10, or a tenth of train.steps for a run of 10 steps or fewer.",
    )
    lr_schedule_steps: int | None = Field(
        None,
        ge=1,
        description="Steps the warmup + cosine LR schedule spans (past them the LR stays at min_lr_ratio x "
        "lr); null = train.steps. A resume that changes train.steps sets it as lr_schedule_on_resume says.",
    )
    lr_schedule_on_resume: Literal["keep", "stretch"] = Field(
        "keep",
        description="A resume that changes train.steps (training further): keep = the LR schedule keeps "
        "the length the run had (no jump in the LR; past that length it stays at its floor); stretch = "
        "fitted to the new train.steps (the LR at the resumed step changes). Either is said at submit.",
    )
    weight_decay: float = Field(0.01, ge=0, description="AdamW weight decay.")
    betas: list[float] = Field(
        default_factory=lambda: [0.9, 0.95], description="AdamW betas (two values in [0, 1))."
    )
    grad_clip: float | None = Field(1.0, gt=0, description="Clip the global grad norm to this; null = off.")
    mode: Literal["joint", "l2t", "t2l"] = Field(
        "joint",
        description="joint: both noised; l2t: latents clean, text generated; t2l: the reverse.",
    )
    text_weight: float = Field(1.0, ge=0, description="Weight of the masked-diffusion text loss.")
    latent_weight: float = Field(1.0, ge=0, description="Weight of the flow-matching latent loss.")
    precision: Literal["auto", "fp32", "bf16"] = Field(
        "auto", description="auto = bf16 autocast on CUDA, fp32 on CPU."
    )
    log_every: int = Field(10, ge=1, description="Steps between metrics lines.")
    max_nonfinite_skips: int = Field(
        5, ge=1, description="Consecutive non-finite steps that end the run with an error."
    )
    parallel: Literal["ddp", "fsdp"] = Field(
        "ddp",
        description="ddp: every rank holds the whole model; fsdp: FSDP2 shards parameters, gradients and optimizer state per MMDiT block. One rank trains the model itself either way.",
    )
    fsdp_shard_size: int | None = Field(
        None,
        ge=1,
        description="fsdp: shard within groups of this many ranks and replicate across groups (HSDP, e.g. the GPUs of a node); null = all ranks.",
    )
    activation_checkpointing: bool = Field(
        False, description="Recompute each MMDiT block's activations in the backward pass (less memory)."
    )
    compile: bool = Field(False, description="torch.compile each MMDiT block.")
    deterministic: bool = Field(
        True,
        description="Deterministic kernels, TF32 off: a resumed run is bitwise equal to an uninterrupted "
        "one. false = the fastest kernels (TF32, cuDNN autotuning, non-deterministic attention backward); "
        "resume still continues at the exact sample with the same random draws.",
    )
    profile: ProfileKnob | None = Field(
        None, description="Profile some steps with torch.profiler into RUN/profile (null = off)."
    )
    ema_decay: float | None = Field(
        None,
        gt=0,
        lt=1,
        description="Keep an exponential moving average of the weights (e.g. 0.9999), used by validation and sampling; null = off.",
    )
    eval_every: int | None = Field(
        None, ge=1, description="Steps between validation losses (needs a validation set); null = off."
    )
    eval_samples: int = Field(
        256, ge=1, description="Validation samples per evaluation (the same fixed ones every time)."
    )
    tensorboard: bool = Field(True, description="Write TensorBoard event files to RUN/tensorboard (rank 0).")
    memory_budget_gb: float | None = Field(
        None,
        gt=0,
        description="GPU memory per rank that preflight's estimate must fit; null = what the probe sees on the GPUs.",
    )
    init_from: str | None = Field(
        None,
        description="Start from another run's weights: a run directory (its newest valid checkpoint) or one "
        "checkpoint directory; weights only (fresh optimizer, step 0, data position 0), until this run has "
        "its own checkpoint.",
    )
    init_from_ema: bool = Field(
        False,
        description="With init_from: take the checkpoint's EMA weights (train.ema_decay) as the model's.",
    )
    wandb: WandbConfig | None = Field(
        None, description="Log to Weights & Biases (project, entity, name, tags, mode); null = off."
    )

    @field_validator("betas")
    @classmethod
    def _two_betas(cls, v: list[float]) -> list[float]:
        if len(v) != 2 or not all(0 <= b < 1 for b in v):
            raise ValueError(f"{v} must be two values in [0, 1)")
        return v

    @model_validator(mode="before")
    @classmethod
    def _default_warmup_fits(cls, data: Any) -> Any:
        """A short run (`--set train.steps=5`) needs no second override: the default warmup scales."""
        if isinstance(data, dict) and "warmup_steps" not in data:
            steps = data.get("steps", 200)
            if isinstance(steps, int) and not isinstance(steps, bool) and 1 <= steps <= 10:
                return {**data, "warmup_steps": steps // 10}
        return data

    @model_validator(mode="after")
    def _cross_fields(self) -> TrainConfig:
        if self.warmup_steps >= self.steps and self.steps > 1:
            raise KeyedValueError(
                "warmup_steps",
                f"{self.warmup_steps} must be smaller than train.steps={self.steps}",
                related=("steps",),
            )
        length = self.lr_schedule_steps
        if length is not None and self.warmup_steps >= length and length > 1:
            raise KeyedValueError(
                "warmup_steps",
                f"{self.warmup_steps} must be smaller than train.lr_schedule_steps={length}",
                related=("lr_schedule_steps",),
            )
        if self.text_weight == 0 and self.latent_weight == 0:
            raise KeyedValueError(
                "latent_weight", "text_weight and latent_weight are both 0: nothing to train"
            )
        if self.mode == "l2t" and self.text_weight == 0:
            raise KeyedValueError("text_weight", "is 0 but mode l2t generates text")
        if self.mode == "t2l" and self.latent_weight == 0:
            raise KeyedValueError("latent_weight", "is 0 but mode t2l generates latents")
        if self.init_from_ema and not self.init_from:
            raise KeyedValueError(
                "init_from_ema", "needs train.init_from (the run or checkpoint to start from)"
            )
        return self


def _whole_or_auto(v: Any, most: int | None, what: str) -> int | str:
    """``auto``, or a whole number from 1 to ``most`` (no bound: None); else "V is not WHAT"."""
    if v == "auto":
        return "auto"
    text = str(v).strip()
    whole = not isinstance(v, bool) and (isinstance(v, int) or text.isdigit())
    if not whole or int(text) < 1 or (most is not None and int(text) > most):
        raise ValueError(f"{v!r} is not {what}")
    return int(text)


class MemoryTierConfig(_Section):
    every_steps: int | Literal["auto"] | None = Field(
        None,
        description="Snapshot the state into the node's shared memory every this many steps, between "
        "disk checkpoints: a crash or hang restarted in place resumes from the newest complete snapshot "
        "when it is newer than the newest checkpoint on disk; auto = the interval that loses the least "
        "expected time (sqrt(2 x a snapshot's measured whole cost x MTBF), as checkpoint.every_steps: "
        "auto); null = off.",
    )

    @field_validator("every_steps", mode="before")
    @classmethod
    def _steps_auto_or_off(cls, v: Any) -> int | str | None:
        if v is None:
            return None
        return _whole_or_auto(v, None, "a step count: use a whole number >= 1, auto, or null (off)")

    keep_last: int = Field(2, ge=1, description="Snapshots kept in memory, newest first.")
    replicas: int = Field(
        1,
        ge=0,
        le=1,
        description="Copies of each rank's snapshot kept on another node (its buddy: the same local rank "
        "on the next node), so that a spare replacing a dead node restores from memory too; 0 = none. "
        "On one node there is no other node: nothing is copied.",
    )
    dir: str | None = Field(
        None,
        description="The node's tmpfs the snapshots go to, an absolute path that exists on every node "
        "(never created): under it each user has a private directory, hpclaunch-<uid>/<run id>; "
        "null = /dev/shm.",
    )
    wait_s: float = Field(
        30.0,
        gt=0,
        le=3600,
        description="Longest a snapshot may still be moving when training must wait for it (the next "
        "snapshot, a stop's save), counted from its start; past it the tier steps aside for the rest "
        "of the attempt (a peer is gone or stuck) and the disk tier serves.",
    )

    @field_validator("dir")
    @classmethod
    def _absolute(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith("/"):
            raise ValueError(f"{v!r} is not an absolute path: name the node's tmpfs, e.g. /dev/shm")
        return v


class CheckpointConfig(_Section):
    every_steps: int | Literal["auto"] = Field(
        50,
        description="Periodic (asynchronous) save interval in steps; auto = the interval that loses the "
        "least expected time (Young/Daly: sqrt(2 x measured save cost x MTBF)), from this run's own "
        "measurements and checkpoint.mtbf_hours, recomputed after every save.",
    )
    every_minutes: float | None = Field(
        None,
        gt=0,
        le=10080,
        description="Save about every this many minutes instead (steps from the measured step time); "
        "when set, every_steps is not used.",
    )
    mtbf_hours: float = Field(
        5000.0,
        gt=0,
        description="Expected hours between failures of one node, for every_steps: auto; the run's "
        "is this divided by scheduler.nodes, corrected by the failures its ledger has seen.",
    )
    keep_last: int = Field(2, ge=1, description="Checkpoints kept, newest first.")
    keep_every: int | None = Field(
        None, ge=1, description="Also keep every checkpoint whose step is a multiple of this."
    )
    async_save: bool = Field(
        True, description="Periodic saves in the background (the stop save is always synchronous)."
    )
    dir: str | None = Field(None, description="Checkpoint directory; null = RUN/checkpoints.")
    writer: Literal["process", "thread"] = Field(
        "process",
        description="Where background saves are written: process (a writer process per rank, fed "
        "through shared memory: no GIL shared with training) or thread (a thread of the training process).",
    )
    writer_nice: int = Field(
        10,
        ge=0,
        le=19,
        description="Niceness added to the background writer (Linux): where every core trains, "
        "its CPU work (copies, hashing) yields to the training step; 0 = same priority as training.",
    )
    write_threads: int | Literal["auto"] = Field(
        "auto",
        description="Threads each rank writes and hashes its checkpoint files with (one file per "
        "thread): auto = the node's cores over its ranks, at most 8; 1 = one file per rank. On an "
        "H200 one thread wrote 18.6 GB at 0.39 GB/s.",
    )
    writer_idle: bool = Field(
        True,
        description="The writer process runs only on CPU time nothing else wants (Linux SCHED_IDLE; "
        "a save then waits for idle time where every core trains; a writer a rank must wait for and "
        "finds starved of CPU is replaced by one at writer_nice); false = at writer_nice.",
    )

    memory: MemoryTierConfig = Field(default_factory=MemoryTierConfig)  # type: ignore[arg-type]

    @field_validator("write_threads", mode="before")
    @classmethod
    def _threads_or_auto(cls, v: Any) -> int | str:
        return _whole_or_auto(v, 64, "a thread count: use a whole number from 1 to 64, or auto")

    @field_validator("every_steps", mode="before")
    @classmethod
    def _steps_or_auto(cls, v: Any) -> int | str:
        return _whole_or_auto(v, None, "a step count: use a whole number >= 1, or auto")


class PreflightConfig(_Section):
    node_checks: bool = Field(True, description="Run node-level checks in the job before the ranks start.")
    distributed_smoke: bool = Field(
        True, description="all_reduce + barrier across all ranks before training."
    )
    smoke_timeout_s: int = Field(60, ge=1, description="Timeout of the distributed smoke test.")
    max_node_excludes: int = Field(
        2,
        ge=0,
        description="SLURM: nodes that failed a check may be excluded and the job requeued this often.",
    )
    min_free_disk_gb: float = Field(
        1.0, ge=0, description="Free space required at the run directory besides checkpoints."
    )


class WatchdogConfig(_Section):
    """The node agent's watchdog over every rank's progress (``jobs.watchdog``)."""

    enabled: bool = Field(
        True,
        description="Watch every rank's progress; a window without progress is a hang: stacks dumped, "
        "attempt ended and continued.",
    )
    launch_s: int = Field(
        600,
        ge=10,
        description="Window from the rank host's start to each rank's first report (imports, rendezvous).",
    )
    startup_s: int = Field(
        600,
        ge=10,
        description="Window from a rank's first report to its first step (smoke test, data check, model).",
    )
    checkpoint_s: int = Field(
        900, ge=10, description="Window for one checkpoint load or save (also evaluation and teardown)."
    )
    step_min_s: int = Field(
        60,
        ge=5,
        description="Training window: a step phase may last max(step_min_s, step_factor x slowest step).",
    )
    step_factor: float = Field(
        10.0, ge=1, description="k in the training window max(step_min_s, k x the slowest recent step)."
    )
    poll_s: float = Field(
        2.0, gt=0, le=60, description="Seconds between the node agent's reads of the ranks' progress files."
    )
    dump_wait_s: float = Field(
        10.0,
        gt=0,
        le=600,
        description="Seconds a hang's stack dumps may take before the workers are stopped.",
    )
    straggler_every: int = Field(
        50, ge=1, description="Steps per per-rank step-time summary (RUN/steptimes/rank<r>.jsonl)."
    )
    straggler_threshold: float = Field(
        0.5,
        gt=0,
        description="A rank is slow when its own work per step exceeds the fastest's by this fraction.",
    )
    straggler_windows: int = Field(
        3, ge=1, description="Slow summaries in a row that make a rank a straggler (ledger and status)."
    )


ContainerRuntime = Literal["none", "pyxis", "apptainer", "singularity", "podman", "charliecloud"]
# A mount: an absolute host path, optionally the absolute path inside, optionally :ro or :rw. No
# commas (pyxis and Apptainer separate mounts by them) and nothing a runtime would read as syntax.
_MOUNT_PART_RE = re.compile(r"^/[A-Za-z0-9._+@%=/-]*$")


class ContainerConfig(_Section):
    """Run each node's rank host and its ranks inside an image (the node agent stays on the node)."""

    runtime: ContainerRuntime = Field(
        "none",
        description="Run the ranks in an image: pyxis (srun --container-image, SLURM only), apptainer, "
        "singularity, podman, charliecloud (ch-run); none = directly on the node.",
    )
    image: str | None = Field(
        None,
        description="The image: a path (.sif or squashfs file, Charliecloud or podman rootfs directory) or "
        "a registry reference (docker://..., nvcr.io#nvidia/pytorch:24.05-py3, docker.io/...).",
    )
    python: str = Field(
        "python3",
        description="The image's Python; it must import hpclaunch (the same version), torch and mmdit.",
    )
    mounts: list[str] = Field(
        default_factory=list,
        description="More host paths in the container: /path (same path), /src:/dst, :ro for read-only; the "
        "run directory, checkpoints and data are mounted at their own paths always.",
    )
    workdir: str | None = Field(None, description="Working directory inside; null = the run directory.")
    env: list[str] = Field(
        default_factory=list,
        description="Names of variables passed from the node into the container, the node's value winning "
        "over the image's; launch.env and launch.pass_env always pass. Values are never written.",
    )
    flags: list[str] = Field(
        default_factory=list,
        description="The runtime's own extra options, one argument each (e.g. [--writable-tmpfs]).",
    )
    command: str | None = Field(
        None,
        description="The runtime's executable; null = srun, apptainer, singularity, podman or ch-run "
        "(e.g. podman-hpc at NERSC).",
    )

    @field_validator("runtime", mode="before")
    @classmethod
    def _null_is_none(cls, v: Any) -> Any:
        return "none" if v is None else v

    @field_validator("mounts")
    @classmethod
    def _mounts_are_paths(cls, v: list[str]) -> list[str]:
        for i, mount in enumerate(v):
            parts = mount.split(":")
            mode_ok = len(parts) < 3 or (len(parts) == 3 and parts[2] in ("ro", "rw"))
            if not (mode_ok and all(_MOUNT_PART_RE.fullmatch(p) for p in parts[:2])):
                raise ValueError(
                    f"entry {i} {mount!r} is not a mount: use /host/path, /host/path:/path/inside or "
                    "/host/path:/path/inside:ro (absolute paths; letters, digits and ._+@%=/- only)"
                )
        return v

    @field_validator("workdir")
    @classmethod
    def _workdir_absolute(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith("/"):
            raise ValueError(f"{v!r} is not an absolute path inside the container")
        return v

    @field_validator("env")
    @classmethod
    def _env_names(cls, v: list[str]) -> list[str]:
        for name in v:
            if not ENV_NAME_RE.fullmatch(name):
                raise ValueError(
                    f"{name!r} is not a variable name (give names only; values pass from the node)"
                )
        return v

    @field_validator("python", "command")
    @classmethod
    def _one_word(cls, v: str | None, info: Any) -> str | None:
        if v is not None and (not v.strip() or any(c.isspace() for c in v)):
            raise ValueError(f"{v!r} is not one executable (a name or a path, no spaces)")
        return v

    @model_validator(mode="after")
    def _image_with_runtime(self) -> ContainerConfig:
        if self.runtime != "none" and not self.image:
            raise KeyedValueError(
                "image",
                f"is missing: container.runtime {self.runtime} needs the image to run",
                related=("runtime",),
            )
        if self.runtime == "none" and self.image:
            raise KeyedValueError(
                "runtime",
                "is none but container.image is set: name the runtime that runs it "
                "(pyxis, apptainer, singularity, podman, charliecloud)",
                related=("image",),
            )
        return self

    @property
    def enabled(self) -> bool:
        return self.runtime != "none"

    @property
    def image_is_path(self) -> bool:
        """The image is a file or directory (not a registry reference): it can be looked at here,
        and a relative path is resolved like the data directories."""
        image = self.image or ""
        if self.runtime == "charliecloud":
            return True
        if self.runtime in ("apptainer", "singularity"):
            return "://" not in image
        return image.startswith(("/", ".", "~"))  # podman, pyxis: a reference otherwise


class ScriptConfig(_Section):
    """Your own training script instead of the built-in MMDiT trainer (docs/byo.md)."""

    path: str | None = Field(
        None,
        description="A torch training script that calls hpclaunch.attach (docs/byo.md): every rank runs "
        "it as __main__ with torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, "
        "MASTER_PORT ...); null = the built-in MMDiT trainer. The model, data and train sections "
        "belong to the built-in trainer and are refused beside it.",
    )
    args: list[str] = Field(
        default_factory=list, description="The script's command-line arguments (its sys.argv[1:])."
    )
    workdir: str | None = Field(
        None,
        description="The working directory every rank runs the script in; null = the directory "
        "hpclaunch was run from (recorded at submit, as for the script's relative paths).",
    )
    preload: list[str] = Field(
        default_factory=list,
        description="Modules each node's rank host imports once per allocation before it forks the "
        "ranks (the script's slow imports, e.g. transformers): every attempt's ranks, in-place "
        "restarts included, start with them imported.",
    )

    @field_validator("args", mode="before")
    @classmethod
    def _args_as_text(cls, v: Any) -> Any:
        """``args: [--steps, 100]``: YAML reads 100 as a number; a command line is text."""
        if isinstance(v, list):
            return [
                str(a).lower() if isinstance(a, bool) else str(a) if isinstance(a, (int, float)) else a
                for a in v
            ]
        return v

    @field_validator("preload")
    @classmethod
    def _module_names(cls, v: list[str]) -> list[str]:
        for name in v:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*", name):
                raise ValueError(f"{name!r} is not a module name (e.g. transformers, mypkg.model)")
        return v


class HangKnob(_Section):
    """One injected hang: ``rank`` stops forever when it enters ``phase`` (of ``step``, when given)."""

    rank: int = Field(..., ge=0, description="The rank that hangs.")
    phase: Literal["startup", "load", "data", "compute", "collective", "save"] = Field(
        "data", description="Where it hangs (startup: before the distributed smoke test)."
    )
    step: int | None = Field(None, ge=1, description="Only at this step; null = the first time.")

    @model_validator(mode="after")
    def _step_only_in_training(self) -> HangKnob:
        if self.step is not None and self.phase in ("startup", "load"):
            raise KeyedValueError("step", f"{self.phase} comes before any step; leave step out")
        return self


class FailNodeCheckKnob(_Section):
    host: str = Field(..., description="The host (as the scheduler names it) whose node check fails.")
    from_in_place: int = Field(
        1, ge=0, description="From this in-place attempt of an allocation on (0: from its first)."
    )


class SlowRankKnob(_Section):
    rank: int = Field(..., ge=0, description="The rank that is slow.")
    seconds: float = Field(..., gt=0, le=60, description="CPU seconds it burns in every step's data phase.")


class TestingConfig(_Section):
    """Test and demo knobs: they change timing or inject faults, never the math of a healthy run.

    Not part of the user's reference (docs/configuration.md, ``hpclaunch init``); left out of the config hash."""

    step_sleep_s: float = Field(
        0.0, ge=0, description="Extra seconds per step (slows a tiny model; math unchanged)."
    )
    inject_nonfinite_at: list[int] = Field(
        default_factory=list, description="Make the loss non-finite at these steps."
    )
    hang: list[HangKnob] = Field(
        default_factory=list, description="Hangs to inject; each fires once per run (a marker file)."
    )
    slow_rank: SlowRankKnob | None = Field(None, description="Make one rank slow (a straggler).")
    fail_node_check: FailNodeCheckKnob | None = Field(
        None, description="Make one host's node check fail (a bad GPU found between attempts)."
    )
    stop_at_step: int | None = Field(
        None, ge=1, description="Rank 0 asks for a user's stop after this step (once per run)."
    )
    crash_at_step: int | None = Field(
        None, ge=1, description="The last rank dies (os._exit) after this step (once per run)."
    )
    trace_steps: bool = Field(
        False,
        description="Every rank writes RUN/trace/rank<r>.jsonl: each step's random state at its start "
        "and end, every attached object's digest and what was logged (verify-resume compares them).",
    )
    pause_before_continue_s: float = Field(
        0.0,
        ge=0,
        description="Node 0's agent waits this long between deciding to continue and asking the "
        "scheduler (widens the window a late cancellation must not fall through).",
    )


class RunConfig(_Section):
    name: str = Field("run", description="Run name; the run directory defaults to runs/<name>.")
    run_dir: str | None = Field(None, description="Run directory; null = runs/<name>.")
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)  # type: ignore[arg-type]
    launch: LaunchConfig = Field(default_factory=LaunchConfig)  # type: ignore[arg-type]
    nccl: NcclConfig = Field(default_factory=NcclConfig)  # type: ignore[arg-type]
    model: ModelConfig = Field(default_factory=ModelConfig)  # type: ignore[arg-type]
    data: DataConfig = Field(default_factory=DataConfig)  # type: ignore[arg-type]
    train: TrainConfig = Field(default_factory=TrainConfig)  # type: ignore[arg-type]
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)  # type: ignore[arg-type]
    preflight: PreflightConfig = Field(default_factory=PreflightConfig)  # type: ignore[arg-type]
    watchdog: WatchdogConfig = Field(default_factory=WatchdogConfig)  # type: ignore[arg-type]
    container: ContainerConfig = Field(default_factory=ContainerConfig)  # type: ignore[arg-type]
    script: ScriptConfig = Field(default_factory=ScriptConfig)  # type: ignore[arg-type]
    testing: TestingConfig = Field(default_factory=TestingConfig)  # type: ignore[arg-type]

    # Where the values came from, for checks made after loading (a data directory that does not
    # exist, an init_from that cannot start the run): the layer that set each key, and each path as
    # given before ``resolved`` made it absolute.
    _sources: dict[str, str] = PrivateAttr(default_factory=dict)
    _where: str = PrivateAttr(default="config")
    _relative_paths: dict[str, tuple[str, str]] = PrivateAttr(default_factory=dict)  # key -> (given, base)

    def origin(self, key: str) -> str:
        """The file, ``--set`` or flag that set ``key`` (or its section); the config's name else."""
        return source_of(key, self._sources, self._where)

    def path_said(self, key: str, value: str) -> str:
        """``value`` of the path ``key`` as the user gave it: "data/x (relative to the working
        directory /home/u: /home/u/data/x)" when it was relative, else the path."""
        given = self._relative_paths.get(key)
        if given is None or given[0] == value:
            return value
        return f"{given[0]} (relative to the working directory {given[1]}: {value})"

    @model_validator(mode="before")
    @classmethod
    def _no_control_characters(cls, raw: Any) -> Any:
        """Every value may reach a job script or a shell (directives, exports, paths): a newline in
        ``partition: "gpu\n"`` would end a ``#PBS -q`` line early and every later directive would
        be ignored. No string anywhere in the config may hold a control character."""
        found = _first_control_character(raw, [])
        if found is not None:
            key, value = found
            raise KeyedValueError(
                key, f"{value!r} holds a control character (newline, tab, ...); values must be one plain line"
            )
        return raw

    @model_validator(mode="before")
    @classmethod
    def _script_or_builtin(cls, raw: Any) -> Any:
        """A script run trains its own model: the built-in MMDiT trainer's sections beside
        ``script.path`` would be silently ignored, so they are refused, naming the first key."""
        if not isinstance(raw, Mapping):
            return raw
        script = raw.get("script")
        if isinstance(script, Mapping) and not script.get("path"):
            for key in ("args", "preload", "workdir"):
                if script.get(key):
                    raise KeyedValueError(
                        f"script.{key}",
                        "is for a script, but there is no script.path: give --script SCRIPT (or "
                        "script.path), or drop it (the arguments after -- are the script's)",
                    )
        if not (isinstance(script, Mapping) and script.get("path")):
            return raw
        for section in BUILTIN_SECTIONS:
            value = raw.get(section)
            if value is None:
                continue
            keys = [f"{section}.{k}" for k in value] if isinstance(value, Mapping) and value else [section]
            raise KeyedValueError(
                keys[0],
                f"is a key of the built-in MMDiT trainer; this run trains script.path "
                f"({script['path']}), which owns its model, data and steps: remove the {section} section",
            )
        return raw

    @field_validator("name")
    @classmethod
    def _name_safe(cls, v: str) -> str:
        if not NAME_RE.fullmatch(v):
            raise ValueError(f"{v!r} is not a run name: use letters, digits and ._- (at most 64)")
        return v

    @model_validator(mode="after")
    def _cross_sections(self) -> RunConfig:
        s, t = self.scheduler, self.train
        world = s.world_size
        if self.launch.backend == "nccl" and s.gpus_per_node == 0:
            raise KeyedValueError(
                "launch.backend",
                "nccl needs GPUs; with scheduler.gpus_per_node 0 use gloo (or auto)",
            )
        self._check_common(world)
        if self.script.path:
            return self  # (the train, data and model checks are the built-in trainer's)
        micro = t.micro_batch if t.micro_batch is not None else t.global_batch // max(world, 1)
        if t.global_batch % world:
            raise KeyedValueError(
                "train.global_batch",
                f"{t.global_batch} is not divisible by the {world} ranks (scheduler.nodes x procs_per_node)",
                related=("scheduler.nodes", "scheduler.procs_per_node", "scheduler.gpus_per_node"),
            )
        if micro < 1 or (t.global_batch // world) % micro:
            raise KeyedValueError(
                "train.micro_batch",
                f"{t.micro_batch} must divide the per-rank batch {t.global_batch // world}",
                related=("train.global_batch", "scheduler.nodes", "scheduler.procs_per_node"),
            )
        if self.train.precision == "bf16" and s.gpus_per_node == 0:
            raise KeyedValueError("train.precision", "bf16 needs GPUs; CPU ranks train in fp32 (use auto)")
        for step in self.testing.inject_nonfinite_at:
            if not 1 <= step <= t.steps:
                raise KeyedValueError("testing.inject_nonfinite_at", f"step {step} is outside 1..{t.steps}")
        self._check_data_and_parallel()
        return self

    def _check_common(self, world: int) -> None:
        """What holds for a script run and the built-in trainer alike."""
        s = self.scheduler
        lead = self.launch.stop_lead_s
        if lead is not None and lead >= s.time_limit_s:
            raise KeyedValueError(
                "launch.stop_lead_s",
                f"{lead} is not shorter than scheduler.time_limit {s.time_limit} ({s.time_limit_s} s): "
                "the run would stop before it starts",
                related=("scheduler.time_limit",),
            )
        knobs = [("testing.hang", h.rank) for h in self.testing.hang]
        if self.testing.slow_rank is not None:
            knobs.append(("testing.slow_rank", self.testing.slow_rank.rank))
        for key, rank in knobs:
            if rank >= world:
                raise KeyedValueError(key, f"rank {rank} does not exist (world size {world})")
        self._check_container_paths()
        if self.container.runtime == "pyxis" and s.kind != "slurm":
            raise KeyedValueError(
                "container.runtime",
                f"pyxis is a SLURM plugin (srun --container-image); with scheduler.kind {s.kind} use "
                "apptainer, podman or charliecloud",
                related=("scheduler.kind",),
            )

    def _check_container_paths(self) -> None:
        """What is mounted into the container goes into mount lists that ',' and ':' separate."""
        if not self.container.enabled:
            return
        d = self.data
        paths = [("run_dir", self.run_dir), ("checkpoint.dir", self.checkpoint.dir)]
        if self.script.path:
            paths += [("script.path", self.script.path), ("script.workdir", self.script.workdir)]
        else:
            paths += [("data.token_dir", d.token_dir), ("data.latent_dir", d.latent_dir)]
            paths += [("data.val_token_dir", d.val_token_dir), ("data.val_latent_dir", d.val_latent_dir)]
            paths.append(("train.init_from", self.train.init_from))
        for key, path in paths:
            if path and ("," in str(path) or ":" in str(path)):
                raise KeyedValueError(
                    key,
                    f"{str(path)!r} cannot be mounted into the container (',' and ':' separate mounts); "
                    "use a path without them",
                    related=("container.runtime",),
                )

    def _check_data_and_parallel(self) -> None:
        d, t, m = self.data, self.train, self.model
        if d.pad_id is not None and d.pad_id >= m.vocab_size:
            raise KeyedValueError(
                "data.pad_id",
                f"{d.pad_id} is outside the vocabulary (model.vocab_size={m.vocab_size}: ids 0..{m.vocab_size - 1}); "
                "use the tokenizer's pad id",
                related=("model.vocab_size",),
            )
        if (d.val_token_dir is None) != (d.val_latent_dir is None):
            missing = "data.val_latent_dir" if d.val_latent_dir is None else "data.val_token_dir"
            raise KeyedValueError(
                missing, "is missing: validation needs both val_token_dir and val_latent_dir"
            )
        if d.val_token_dir is not None and d.val_fraction > 0:
            raise KeyedValueError(
                "data.val_fraction", "give validation directories or a held-out fraction, not both"
            )
        if t.eval_every is not None and d.val_token_dir is None and d.val_fraction == 0:
            raise KeyedValueError(
                "train.eval_every",
                "needs a validation set: set data.val_token_dir + data.val_latent_dir or data.val_fraction",
            )
        world = self.scheduler.world_size
        if t.fsdp_shard_size is not None:
            if t.parallel != "fsdp":
                raise KeyedValueError("train.fsdp_shard_size", "only applies to train.parallel: fsdp")
            if world % t.fsdp_shard_size:
                raise KeyedValueError(
                    "train.fsdp_shard_size",
                    f"{t.fsdp_shard_size} does not divide the {world} ranks (scheduler.nodes x procs_per_node)",
                )

    # ---- derived values -------------------------------------------------------------------

    @property
    def backend(self) -> Literal["nccl", "gloo"]:
        if self.launch.backend != "auto":
            return self.launch.backend
        return "nccl" if self.scheduler.gpus_per_node > 0 else "gloo"

    @property
    def per_rank_batch(self) -> int:
        return self.train.global_batch // self.scheduler.world_size

    @property
    def micro_batch(self) -> int:
        return self.train.micro_batch or self.per_rank_batch

    @property
    def grad_accum(self) -> int:
        return self.per_rank_batch // self.micro_batch

    # ---- CPUs per node: the ranks' share (the rank itself, its loader workers, its writer) ------

    @property
    def helpers_per_rank(self) -> int:
        """Processes each rank keeps busy besides itself: its loader workers and its checkpoint writer."""
        return self.data.num_workers + 1

    @property
    def cpus_needed(self) -> int:
        """CPUs per node the ranks use: ranks x (the rank + its helpers); ``cpus_per_node``'s default."""
        return self.scheduler.nprocs * (1 + self.helpers_per_rank)

    @property
    def cpus_per_node(self) -> int:
        """The CPUs per node the job asks for (``all``: at least the ranks' need, the node is whole)."""
        n = self.scheduler.cpus_per_node
        return n if isinstance(n, int) else self.cpus_needed

    @property
    def omp_threads(self) -> int | None:
        """Each rank's OpenMP threads: its share of the node less its helpers (at least 1); None for
        ``cpus_per_node: all``, where the script counts the node's CPUs when it runs."""
        if self.scheduler.cpus_per_node == "all":
            return None
        return omp_threads(self.cpus_per_node, self.scheduler.nprocs, self.helpers_per_rank)

    def cpu_shortfall(self) -> str | None:
        """One line when a ``cpus_per_node`` the user gave starves the loaders: fewer CPUs than
        ranks x (loader workers + 1); None otherwise."""
        n, s = self.scheduler.cpus_per_node, self.scheduler
        floor = s.nprocs * (self.data.num_workers + 1)
        if s.kind == "local" or not isinstance(n, int) or n >= floor:  # (local: no CPUs are allocated)
            return None
        return (
            f"scheduler.cpus_per_node {n} is fewer than the {s.nprocs} rank(s) x (data.num_workers "
            f"{self.data.num_workers} + 1) = {floor} processes that read and train on each node: they "
            f"take turns on the CPUs; set cpus_per_node to at least {floor} (or null: {self.cpus_needed}), "
            "or all for the whole node"
        )

    def run_path(self) -> Path:
        return Path(self.run_dir) if self.run_dir else Path("runs") / self.name

    def resolved(self, base: Path) -> RunConfig:
        """A copy whose paths (run_dir, data dirs, checkpoint dir) are absolute against ``base``."""

        def absolute(p: str | Path) -> str:
            p = Path(os.path.expanduser(str(p)))
            return str(p if p.is_absolute() else (base / p).resolve())

        update: dict[str, Any] = {"run_dir": absolute(self.run_path())}
        data = self.data.model_copy(
            update={
                "token_dir": absolute(self.data.token_dir),
                "latent_dir": absolute(self.data.latent_dir),
                "val_token_dir": absolute(self.data.val_token_dir) if self.data.val_token_dir else None,
                "val_latent_dir": absolute(self.data.val_latent_dir) if self.data.val_latent_dir else None,
            }
        )
        update["data"] = data
        if self.checkpoint.dir:
            update["checkpoint"] = self.checkpoint.model_copy(update={"dir": absolute(self.checkpoint.dir)})
        if self.train.init_from:
            update["train"] = self.train.model_copy(update={"init_from": absolute(self.train.init_from)})
        if self.script.path:
            workdir = absolute(self.script.workdir or base)
            update["script"] = self.script.model_copy(
                update={"path": absolute(self.script.path), "workdir": workdir}
            )
        image = self.container.image
        if image and self.container.image_is_path and not image.startswith("/"):
            update["container"] = self.container.model_copy(update={"image": absolute(image)})
        out = self.model_copy(update=update)
        given = {
            "run_dir": self.run_dir,
            "data.token_dir": self.data.token_dir,
            "data.latent_dir": self.data.latent_dir,
            "data.val_token_dir": self.data.val_token_dir,
            "data.val_latent_dir": self.data.val_latent_dir,
            "checkpoint.dir": self.checkpoint.dir,
            "train.init_from": self.train.init_from,
            "script.path": self.script.path,
        }
        out._relative_paths = {
            key: (str(value), str(base))
            for key, value in given.items()
            if value and not Path(os.path.expanduser(str(value))).is_absolute()
        }
        return out

    @property
    def is_script(self) -> bool:
        """The run trains the user's script (``script.path``), not the built-in MMDiT trainer."""
        return self.script.path is not None

    def to_dict(self) -> dict[str, Any]:
        """The config as written to ``RUN/config.yaml`` (a script run's without the built-in
        trainer's sections, which it refuses on reading back)."""
        return self.model_dump(mode="json", exclude=set(BUILTIN_SECTIONS) if self.is_script else None)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=None)

    def model_hash(self) -> str:
        """Hash of what fixes parameter shapes; a checkpoint is only loadable into an equal one."""
        return _hash(self.model.model_dump(mode="json"))

    def config_hash(self) -> str:
        """Hash of everything that changes the math of the run (not where or how it is scheduled).

        Data *locations* are left out: the same shards staged to node-local scratch, or a
        checkout in another directory, are the same run (and rendered scripts stay byte-stable
        across machines). What the shards contain is checked by the data validation instead.
        """
        if self.is_script:  # (its model's shapes are the model_hash the script's run computes)
            return _hash({"script": Path(self.script.path or "").name, "args": self.script.args})
        math = {k: v for k, v in self.to_dict().items() if k in ("model", "train")}
        defaults = TrainConfig.model_validate({}).model_dump(mode="json")
        math["train"] = {
            k: v
            for k, v in math["train"].items()
            if k not in _NOT_MATH and not (k in _ADDED_LATER and v == defaults[k])
        }
        return _hash(math)


# Train settings that change what is logged or checked, never the weights.
_NOT_MATH: tuple[str, ...] = ("log_every", "eval_every", "eval_samples", "tensorboard", "memory_budget_gb")
# Where a run's first weights come from, and where it logs: once the run has a checkpoint of its own
# they change nothing, so a resume with them changed (or the source moved) is the same run.
_NOT_MATH += ("init_from", "init_from_ema", "wandb")
# Which kernels compute the same formula, and what is measured: a run switched between the
# deterministic and the fast mode, or profiled, is the same run (its resume continues it).
_NOT_MATH += ("deterministic", "profile")
# Settings added after the first release enter the hash only when set away from their default, so
# a run (and its checkpoints, and its rendered scripts) keeps its identity across the upgrade.
_ADDED_LATER: tuple[str, ...] = ("parallel", "fsdp_shard_size", "activation_checkpointing", "compile")
_ADDED_LATER += ("ema_decay",)
_ADDED_LATER += ("lr_schedule_steps",)
# What a resume does to the schedule is applied at submit (it pins lr_schedule_steps, which is math).
_NOT_MATH += ("lr_schedule_on_resume",)


def omp_threads(cpus: int, ranks: int, helpers_per_rank: int) -> int:
    """OpenMP threads per rank on ``cpus`` CPUs: a rank's share less its helper processes, at least 1.
    (The job script computes the same at run time for ``cpus_per_node: all``.)"""
    return max(1, cpus // max(1, ranks) - helpers_per_rank)


def _hash(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


# ---- loading ---------------------------------------------------------------------------------


def load_config(
    path: str | Path | Sequence[str | Path] | None,
    overrides: Sequence[str] = (),
    *,
    base: Path | None = None,
    flags: Sequence[tuple[str, str]] = (),
    run_written: bool = False,
) -> RunConfig:
    """Read ``path`` (None = defaults; several files: layered, see ``merge_layers``), apply
    overrides, then ``flags`` (``(key=value, flag)``: a command's own options that set a key, such as
    ``render --scheduler``), validate once; paths resolved against ``base``. An error names the file
    (or ``--set``, or the flag) that set the bad key. ``run_written``: ``path`` is a run directory's
    own config.yaml (an older version may have written keys removed since: ``RETIRED_KEYS``)."""
    files = [] if path is None else [path] if isinstance(path, (str, Path)) else list(path)
    raw, sources = merge_layers([(str(f), _settings_in(Path(f))) for f in files])
    if run_written:
        drop_retired(raw)
    for item in overrides:
        sources[apply_override(raw, item)] = "--set"
    for item, flag in flags:
        sources[apply_override(raw, item, where=flag)] = flag
    where = " + ".join(str(f) for f in files) or "defaults"
    cfg = validate_config(raw, where=where, sources=sources)
    return cfg.resolved(base) if base is not None else cfg


def merge_layers(layers: Sequence[tuple[str, Mapping[str, Any]]]) -> tuple[dict[str, Any], dict[str, str]]:
    """Later layers override earlier ones key by key (mappings merge, anything else is replaced,
    lists whole); returns the merged mapping and, per dotted key, the layer that set it last."""
    merged: dict[str, Any] = {}
    sources: dict[str, str] = {}

    def merge(into: dict[str, Any], layer: Mapping[str, Any], name: str, prefix: str) -> None:
        for key, value in layer.items():
            dotted = f"{prefix}{key}"
            if isinstance(value, Mapping) and isinstance(into.get(key), dict):
                merge(into[key], value, name, dotted + ".")
            else:
                into[key] = _plain_copy(value)
                for known in [k for k in sources if k.startswith(dotted + ".")]:
                    del sources[known]  # a whole section replaced: its keys are this layer's now
                if isinstance(value, Mapping):
                    merge({}, value, name, dotted + ".")  # records who set each key inside it
            sources[dotted] = name

    for name, layer in layers:
        merge(merged, _new_names(layer, name), name, "")
    return merged, sources


def _new_names(layer: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    """``layer`` with renamed keys under their new names, so that a later layer's new name replaces
    an earlier layer's old one (``RENAMED_KEYS``)."""
    section = layer.get("scheduler")
    if not isinstance(section, Mapping) or not set(_RENAMED_IN_SCHEDULER) & set(section):
        return layer
    renamed: dict[str, Any] = {}
    for key, value in section.items():
        new = _RENAMED_IN_SCHEDULER.get(str(key), str(key))
        if new in renamed or (new != key and new in section):
            raise ConfigError(
                f"scheduler.{key} is the old name of scheduler.{new}; the file sets both",
                where=name,
                hint=f"keep only scheduler.{new}",
            )
        renamed[new] = value
    return {**layer, "scheduler": renamed}


def _plain_copy(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _plain_copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain_copy(v) for v in value]
    return value


def source_of(dotted: str, sources: Mapping[str, str], default: str) -> str:
    """The layer that set ``dotted`` or, failing that, its nearest enclosing section."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        found = sources.get(".".join(parts[:i]))
        if found is not None:
            return found
    return default


def _a_directory(path: Path) -> ConfigError:
    """CONFIG named a directory: a run's (it has its config.yaml) or some other."""
    if (path / "config.yaml").is_file():
        return ConfigError(
            "a run directory, not a CONFIG file",
            where=str(path),
            hint=f"continue that run: hpclaunch submit --resume {path}, or in the foreground: "
            f"hpclaunch train {path} --resume (the config it was started with)",
        )
    return ConfigError("a directory, not a CONFIG file", where=str(path), hint="name the run's YAML file")


def _settings_in(path: Path) -> dict[str, Any]:
    """A CONFIG file's settings; an empty one (or only comments) is refused: it would run on every
    default without a word, which is never what a file named on the command line meant."""
    data = read_yaml_mapping(path)
    if not data:
        raise ConfigError(
            "holds no settings (it is empty, or only comments): every key would take its default",
            where=str(path),
            hint=f"write one with every key: hpclaunch init {path} --force; or name the file you meant",
        )
    return data


def read_yaml_mapping(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(
            "config file not found",
            where=str(path),
            hint="check the path, or create one with 'hpclaunch init'",
        ) from None
    except IsADirectoryError:
        raise _a_directory(path) from None
    except OSError as e:
        raise ConfigError(f"cannot read config file ({e.strerror})", where=str(path)) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        loc = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"not valid YAML ({problem})", where=loc, hint="fix the YAML syntax") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"the top level must be a mapping of sections, not a {type(data).__name__}",
            where=str(path),
        )
    return data


def apply_override(raw: dict[str, Any], item: str, *, where: str = "--set") -> str:
    """Apply one ``dotted.key=value`` (value parsed as a YAML scalar or flow list/map) in place;
    ``where``: the flag it came from (``--set``, ``--sweep``, ...), named by its errors. Returns the
    dotted key it set (a renamed key's new name)."""
    key, sep, text = item.partition("=")
    key = RENAMED_KEYS.get(key.strip(), key.strip())
    if not sep or not key:
        raise ConfigError(
            f"override {item!r} is not of the form dotted.key=value",
            where=where,
            hint=f"e.g. {where} train.lr=1e-4",
        )
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        value = text
    parts = key.split(".")
    _check_known_path(parts, where=where)
    node = raw
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"{'.'.join(parts[: i + 1])} is not a section", where=f"{where} {key}")
        node = child
    node[parts[-1]] = value
    for old_name, new_name in RENAMED_KEYS.items():  # the new name set: the old one goes
        if key == new_name and parts[:-1] == old_name.split(".")[:-1]:
            node.pop(old_name.split(".")[-1], None)
    return key


def _section_model(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        found = _section_model(arg)
        if found is not None:
            return found
    return None


def _check_known_path(parts: Sequence[str], *, where: str) -> None:
    model: type[BaseModel] | None = RunConfig
    for i, part in enumerate(parts):
        if model is None:
            # below a dict-valued field (e.g. launch.env.NAME): any key is allowed
            return
        fields = model.model_fields
        if part not in fields:
            raise _unknown_key(parts[: i + 1], list(fields), where=where)
        annotation = fields[part].annotation
        if get_origin(annotation) is dict or annotation is dict:
            return
        model = _section_model(annotation)
        if model is None and i < len(parts) - 1:
            raise ConfigError(f"{'.'.join(parts[: i + 1])} is a value, not a section", where=where)


# Keys that existed once and were removed: a run directory written before keeps them in its
# config.yaml (dropped when it is read: ``drop_retired``); a user's file or --set is told why.
RETIRED_KEYS = {
    (
        "launch",
        "shutdown_timeout_s",
    ): "it was read by nothing (the rank host's elastic launch stops the ranks)",
}


def drop_retired(raw: dict[str, Any]) -> dict[str, Any]:
    """``raw`` without the retired keys (a run's own config, written by an older version)."""
    for section, key in RETIRED_KEYS:
        part = raw.get(section)
        if isinstance(part, dict):
            part.pop(key, None)
    return raw


def _unknown_key(parts: Sequence[str], allowed: Iterable[str], *, where: str) -> ConfigError:
    dotted = ".".join(parts)
    retired = RETIRED_KEYS.get(tuple(parts))  # type: ignore[arg-type]
    if retired is not None:
        return ConfigError(f"{dotted!r} was removed: {retired}", where=where, hint=f"delete {dotted}")
    prefix = ".".join(parts[:-1])
    allowed = list(allowed)
    suggestion = did_you_mean(parts[-1], allowed, prefix=prefix + "." if prefix else "")
    return ConfigError(
        f"unknown key {dotted!r}{suggestion}",
        where=where,
        hint=f"keys allowed {'under ' + prefix if prefix else 'at the top level'}: {', '.join(allowed)}",
    )


_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")


def _first_control_character(value: Any, path: list[str]) -> tuple[str, str] | None:
    """(dotted key, value) of the first string under ``value`` holding a control character."""
    if isinstance(value, str):
        return (".".join(path), value) if _CONTROL_RE.search(value) else None
    if isinstance(value, Mapping):
        items: Iterable[tuple[str, Any]] = ((str(k), v) for k, v in value.items())
    elif isinstance(value, (list, tuple)):
        items = ((str(i), v) for i, v in enumerate(value))
    else:
        return None
    for key, item in items:
        if isinstance(key, str) and _CONTROL_RE.search(key):
            return ".".join([*path, key]), key
        found = _first_control_character(item, [*path, key])
        if found is not None:
            return found
    return None


def validate_config(
    raw: Mapping[str, Any], *, where: str = "config", sources: Mapping[str, str] | None = None
) -> RunConfig:
    """The typed config; ``sources`` (dotted key -> file, from ``merge_layers``) names in an error
    the file that set the bad key instead of ``where``."""
    try:
        cfg = RunConfig.model_validate(raw)
    except ValidationError as e:
        raise _first_error(e, where, sources or {}) from None
    cfg._sources, cfg._where = dict(sources or {}), where
    return cfg


def _first_error(e: ValidationError, where: str, sources: Mapping[str, str]) -> ConfigError:
    err = e.errors(include_url=False)[0]
    loc = [str(p) for p in err["loc"]]
    where = source_of(".".join(p for p in loc if not p.isdigit()), sources, where)
    keyed = (err.get("ctx") or {}).get("error")
    if isinstance(keyed, KeyedValueError):
        dotted = ".".join([*loc, keyed.key])
        own = source_of(dotted, sources, where)
        layers = [source_of(".".join([*loc, k]), sources, where) for k in keyed.related]
        files = where.split(" + ")  # load_config's where: the files in the order they were merged
        latest = max([own, *layers], key=lambda name: _layer_rank(name, files))
        said_where = f" ({dotted} from {own})" if latest != own and own in sources.values() else ""
        return ConfigError(f"{dotted}: {keyed}{said_where}", where=latest, hint=_hint_for(dotted))
    if err["type"] == "extra_forbidden":
        model: type[BaseModel] = RunConfig
        for part in loc[:-1]:
            sub = _section_model(model.model_fields[part].annotation) if part in model.model_fields else None
            if sub is None:
                break
            model = sub
        return _unknown_key(loc, list(model.model_fields), where=where)
    dotted = ".".join(p for p in loc if not p.isdigit()) or "config"
    field = _field_at(dotted.split("."))
    section = _section_model(field.annotation) if field is not None else None
    if err["type"] in ("model_type", "dict_type") and section is not None:
        # `--set train=5`: pydantic's words name an internal class ("instance of TrainConfig")
        keys = list(section.model_fields)
        return ConfigError(
            f"{dotted} is a section, not a value (got {err.get('input')!r})",
            where=where,
            hint=f"set one of its keys, e.g. {dotted}.{keys[0]}=...; keys under {dotted}: {', '.join(keys)}",
        )
    msg = str(err["msg"])
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
    shown = err.get("input")
    bad = (
        ""
        if isinstance(shown, dict) or err["type"] in ("value_error", "assertion_error")
        else f" (got {shown!r})"
    )
    if err["type"] == "missing":
        bad = ""
    return ConfigError(f"{dotted}: {msg}{bad}", where=where, hint=_hint_for(dotted))


def _layer_rank(name: str, files: list[str]) -> int:
    """Which layer came later: files in the order they were merged, flags (``--set``) after every
    file; anything else (the defaults) first."""
    if name.startswith("--"):
        return len(files) + 1
    return files.index(name) if name in files else -1


def _hint_for(dotted: str) -> str:
    field = _field_at(dotted.split("."))
    if field is not None and field.description:
        return f"{dotted}: {field.description}"
    return "see 'hpclaunch config schema' for every key, its type and bounds"


def _field_at(parts: Sequence[str]) -> Any:
    model: type[BaseModel] | None = RunConfig
    field = None
    for part in parts:
        if model is None or part not in model.model_fields:
            return None
        field = model.model_fields[part]
        model = _section_model(field.annotation)
    return field


def json_schema() -> dict[str, Any]:
    return RunConfig.model_json_schema()


# The built-in MMDiT trainer's own sections: a script run (script.path) has none of them.
BUILTIN_SECTIONS = ("model", "data", "train")

# Sections that are not part of the user's reference (docs/configuration.md, `hpclaunch init`).
INTERNAL_SECTIONS = ("testing",)


def iter_reference_rows() -> Iterable[tuple[str, str, str, str]]:
    """(dotted key, type, default, description) for every leaf key: the config reference
    (docs/configuration.md)."""

    def walk(model: type[BaseModel], prefix: str) -> Iterable[tuple[str, str, str, str]]:
        for name, field in model.model_fields.items():
            dotted = f"{prefix}{name}"
            if dotted in INTERNAL_SECTIONS:
                continue
            sub = _section_model(field.annotation)
            if sub is not None and get_origin(field.annotation) is not dict:
                if field.default is None:  # an optional section, off by default: the row that turns it on
                    yield dotted, "section \\| null", "null", field.description or ""
                yield from walk(sub, dotted + ".")
                continue
            default = field.get_default(call_default_factory=True)
            yield dotted, _type_name(field.annotation), json.dumps(default), field.description or ""

    yield from walk(RunConfig, "")


def _type_name(annotation: Any) -> str:
    origin = get_origin(annotation)
    if origin is Literal:
        return " \\| ".join(str(a) for a in get_args(annotation))
    if origin is None:
        return getattr(annotation, "__name__", str(annotation))
    args = [a for a in get_args(annotation) if a is not type(None)]
    name = " \\| ".join(_type_name(a) for a in args)
    if origin in (list, tuple, dict):
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in args)}]"
    return name + (" \\| null" if type(None) in get_args(annotation) else "")
