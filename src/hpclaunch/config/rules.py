"""The rules across sections (each section checks its own keys): ``RunConfig``'s validators call
these, on the raw mapping before it is read (control characters, a script beside the built-in
trainer's sections) and on the whole tree once it is built (batch sizes, ranks, containers, data).
Each names the dotted key it refuses, relative to the root."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from .checkpoint import CheckpointConfig
from .cluster import LaunchConfig, SchedulerConfig
from .runtime import ContainerConfig, ScriptConfig, TestingConfig
from .section_base import BUILTIN_SECTIONS, KeyedValueError
from .training import DataConfig, ModelConfig, TrainConfig

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


def no_control_characters(raw: Any) -> None:
    """Every value may reach a job script or a shell (directives, exports, paths): a newline in
    ``partition: "gpu\n"`` would end a ``#PBS -q`` line early and every later directive would
    be ignored. No string anywhere in the config may hold a control character."""
    found = _first_control_character(raw, [])
    if found is not None:
        key, value = found
        raise KeyedValueError(
            key, f"{value!r} holds a control character (newline, tab, ...); values must be one plain line"
        )


def script_or_builtin(raw: Any) -> None:
    """A script run trains its own model: the built-in MMDiT trainer's sections beside
    ``script.path`` would be silently ignored, so they are refused, naming the first key."""
    if not isinstance(raw, Mapping):
        return
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
        return
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


def mounted_paths(
    run_dir: str | None,
    checkpoint: CheckpointConfig,
    script: ScriptConfig,
    data: DataConfig,
    train: TrainConfig,
) -> list[tuple[str, str | None]]:
    """(dotted key, path) of every path a container mounts at its own place."""
    paths = [("run_dir", run_dir), ("checkpoint.dir", checkpoint.dir)]
    if script.path:
        paths += [("script.path", script.path), ("script.workdir", script.workdir)]
    else:
        paths += [("data.token_dir", data.token_dir), ("data.latent_dir", data.latent_dir)]
        paths += [("data.val_token_dir", data.val_token_dir), ("data.val_latent_dir", data.val_latent_dir)]
        paths.append(("train.init_from", train.init_from))
    return paths


def check_common(
    scheduler: SchedulerConfig,
    launch: LaunchConfig,
    container: ContainerConfig,
    testing: TestingConfig,
    mounted: Sequence[tuple[str, str | None]],
) -> None:
    """What holds for a script run and the built-in trainer alike (``mounted``: ``mounted_paths``)."""
    s = scheduler
    world = s.world_size
    if launch.backend == "nccl" and s.gpus_per_node == 0:
        raise KeyedValueError(
            "launch.backend",
            "nccl needs GPUs; with scheduler.gpus_per_node 0 use gloo (or auto)",
        )
    lead = launch.stop_lead_s
    if lead is not None and lead >= s.time_limit_s:
        raise KeyedValueError(
            "launch.stop_lead_s",
            f"{lead} is not shorter than scheduler.time_limit {s.time_limit} ({s.time_limit_s} s): "
            "the run would stop before it starts",
            related=("scheduler.time_limit",),
        )
    knobs = [("testing.hang", h.rank) for h in testing.hang]
    if testing.slow_rank is not None:
        knobs.append(("testing.slow_rank", testing.slow_rank.rank))
    for key, rank in knobs:
        if rank >= world:
            raise KeyedValueError(key, f"rank {rank} does not exist (world size {world})")
    check_container_paths(container, mounted)
    if container.runtime == "pyxis" and s.kind != "slurm":
        raise KeyedValueError(
            "container.runtime",
            f"pyxis is a SLURM plugin (srun --container-image); with scheduler.kind {s.kind} use "
            "apptainer, podman or charliecloud",
            related=("scheduler.kind",),
        )


def check_container_paths(container: ContainerConfig, mounted: Sequence[tuple[str, str | None]]) -> None:
    """What is mounted into the container goes into mount lists that ',' and ':' separate."""
    if not container.enabled:
        return
    for key, path in mounted:
        if path and ("," in str(path) or ":" in str(path)):
            raise KeyedValueError(
                key,
                f"{str(path)!r} cannot be mounted into the container (',' and ':' separate mounts); "
                "use a path without them",
                related=("container.runtime",),
            )


def check_builtin(
    scheduler: SchedulerConfig,
    model: ModelConfig,
    data: DataConfig,
    train: TrainConfig,
    testing: TestingConfig,
) -> None:
    """The built-in trainer's rules: batch sizes against the ranks, precision, injected steps, data."""
    s, t = scheduler, train
    world = s.world_size
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
    if t.precision == "bf16" and s.gpus_per_node == 0:
        raise KeyedValueError("train.precision", "bf16 needs GPUs; CPU ranks train in fp32 (use auto)")
    for step in testing.inject_nonfinite_at:
        if not 1 <= step <= t.steps:
            raise KeyedValueError("testing.inject_nonfinite_at", f"step {step} is outside 1..{t.steps}")
    check_data_and_parallel(world, model, data, train)


def check_data_and_parallel(world: int, model: ModelConfig, data: DataConfig, train: TrainConfig) -> None:
    d, t, m = data, train, model
    if d.pad_id is not None and d.pad_id >= m.vocab_size:
        raise KeyedValueError(
            "data.pad_id",
            f"{d.pad_id} is outside the vocabulary (model.vocab_size={m.vocab_size}: ids 0..{m.vocab_size - 1}); "
            "use the tokenizer's pad id",
            related=("model.vocab_size",),
        )
    if (d.val_token_dir is None) != (d.val_latent_dir is None):
        missing = "data.val_latent_dir" if d.val_latent_dir is None else "data.val_token_dir"
        raise KeyedValueError(missing, "is missing: validation needs both val_token_dir and val_latent_dir")
    if d.val_token_dir is not None and d.val_fraction > 0:
        raise KeyedValueError(
            "data.val_fraction", "give validation directories or a held-out fraction, not both"
        )
    if t.eval_every is not None and d.val_token_dir is None and d.val_fraction == 0:
        raise KeyedValueError(
            "train.eval_every",
            "needs a validation set: set data.val_token_dir + data.val_latent_dir or data.val_fraction",
        )
    if t.fsdp_shard_size is not None:
        if t.parallel != "fsdp":
            raise KeyedValueError("train.fsdp_shard_size", "only applies to train.parallel: fsdp")
        if world % t.fsdp_shard_size:
            raise KeyedValueError(
                "train.fsdp_shard_size",
                f"{t.fsdp_shard_size} does not divide the {world} ranks (scheduler.nodes x procs_per_node)",
            )
