"""What runs on the nodes around the ranks: ``preflight`` and ``watchdog`` checks, the ``container``
the ranks run in, the user's own ``script``, and the ``testing`` knobs that inject faults."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from .section_base import ENV_NAME_RE, KeyedValueError, _check_absolute, _Section


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
        return _check_absolute(v, " inside the container")

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
    step_sleep_resumed: bool = Field(
        True,
        description="false: an attempt that resumed from a checkpoint runs at full speed (a test's stop "
        "comes in the first attempt, and the rest of the run ends soon, however slow the start-up).",
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
