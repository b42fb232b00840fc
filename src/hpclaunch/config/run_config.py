"""The root of the tree, ``RunConfig``: every section, the rules across them (``rules``), the values
derived from them (ranks, batches, CPUs), its paths made absolute, and what identifies a run: the
config hash (everything that changes the math) and the model hash (the parameter shapes)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, PrivateAttr, field_validator, model_validator

from .checkpoint import CheckpointConfig
from .cluster import LaunchConfig, NcclConfig, SchedulerConfig
from .layers import source_of
from .rules import check_builtin, check_common, mounted_paths, no_control_characters, script_or_builtin
from .runtime import ContainerConfig, PreflightConfig, ScriptConfig, TestingConfig, WatchdogConfig
from .section_base import BUILTIN_SECTIONS, NAME_RE, _Section
from .training import NOT_SHAPE, DataConfig, ModelConfig, TrainConfig


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
        """No string anywhere in the config may hold a control character (``rules``)."""
        no_control_characters(raw)
        return raw

    @model_validator(mode="before")
    @classmethod
    def _script_or_builtin(cls, raw: Any) -> Any:
        """The built-in trainer's sections beside ``script.path`` are refused (``rules``)."""
        script_or_builtin(raw)
        return raw

    @field_validator("name")
    @classmethod
    def _name_safe(cls, v: str) -> str:
        if not NAME_RE.fullmatch(v):
            raise ValueError(
                f"{v!r} is not a run name: ASCII letters, digits and ._- (at most 64), beginning with a letter or a digit"
            )
        return v

    @model_validator(mode="after")
    def _cross_sections(self) -> RunConfig:
        mounted = mounted_paths(self.run_dir, self.checkpoint, self.script, self.data, self.train)
        check_common(self.scheduler, self.launch, self.container, self.testing, mounted)
        if self.script.path:
            return self  # (the train, data and model checks are the built-in trainer's)
        check_builtin(self.scheduler, self.model, self.data, self.train, self.testing)
        return self

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
        return _resolved(self, base)

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
        """Hash of what fixes parameter shapes (every model setting but ``NOT_SHAPE``); a checkpoint
        is only loadable into an equal one."""
        model = self.model.model_dump(mode="json")
        return _hash({k: v for k, v in model.items() if k not in NOT_SHAPE})

    def model_hashes_accepted(self) -> tuple[str, ...]:
        """Every ``model_hash`` a checkpoint this model loads may carry: its own, then the hash
        written before 2026-11-30, which covered ``flash_attn`` too (either value loads)."""
        model = self.model.model_dump(mode="json")
        return (self.model_hash(), *(_hash({**model, "flash_attn": on}) for on in (False, True)))

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


def _resolved(cfg: RunConfig, base: Path) -> RunConfig:
    """``cfg.resolved(base)``: the paths made absolute, and each relative one as it was given."""

    def absolute(p: str | Path) -> str:
        p = Path(os.path.expanduser(str(p)))
        return str(p if p.is_absolute() else (base / p).resolve())

    update: dict[str, Any] = {"run_dir": absolute(cfg.run_path())}
    data = cfg.data.model_copy(
        update={
            "token_dir": absolute(cfg.data.token_dir),
            "latent_dir": absolute(cfg.data.latent_dir),
            "val_token_dir": absolute(cfg.data.val_token_dir) if cfg.data.val_token_dir else None,
            "val_latent_dir": absolute(cfg.data.val_latent_dir) if cfg.data.val_latent_dir else None,
        }
    )
    update["data"] = data
    if cfg.checkpoint.dir:
        update["checkpoint"] = cfg.checkpoint.model_copy(update={"dir": absolute(cfg.checkpoint.dir)})
    if cfg.train.init_from:
        update["train"] = cfg.train.model_copy(update={"init_from": absolute(cfg.train.init_from)})
    if cfg.script.path:
        workdir = absolute(cfg.script.workdir or base)
        update["script"] = cfg.script.model_copy(
            update={"path": absolute(cfg.script.path), "workdir": workdir}
        )
    image = cfg.container.image
    if image and cfg.container.image_is_path and not image.startswith("/"):
        update["container"] = cfg.container.model_copy(update={"image": absolute(image)})
    out = cfg.model_copy(update=update)
    given = {
        "run_dir": cfg.run_dir,
        "data.token_dir": cfg.data.token_dir,
        "data.latent_dir": cfg.data.latent_dir,
        "data.val_token_dir": cfg.data.val_token_dir,
        "data.val_latent_dir": cfg.data.val_latent_dir,
        "checkpoint.dir": cfg.checkpoint.dir,
        "train.init_from": cfg.train.init_from,
        "script.path": cfg.script.path,
    }
    out._relative_paths = {
        key: (str(value), str(base))
        for key, value in given.items()
        if value and not Path(os.path.expanduser(str(value))).is_absolute()
    }
    return out
