"""The built-in MMDiT trainer's sections: ``model``, ``data`` and ``train`` (with its ``profile`` and
``wandb`` knobs). A script run (``script.path``) has none of them."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from .section_base import KeyedValueError, _Section


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
    flash_attn: bool = Field(
        False,
        description="Use SDPA flash attention in the trunk (kernels, not shapes: a resume may switch it).",
    )


# Model settings that change kernels, not any parameter's shape: a checkpoint loads across them.
NOT_SHAPE: tuple[str, ...] = ("flash_attn",)


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


def default_warmup(run: int) -> int:
    """``train.warmup_steps`` left out, for a run (its schedule) of ``run`` steps: 10, or a tenth of
    a run of 10 steps or fewer, so that it is always shorter than the run."""
    return 10 if run > 10 else run // 10


def _whole(value: Any) -> int | None:
    """A whole number as the config may give it (5, "5"), else None (validation then says why)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    return int(value) if isinstance(value, str) and value.strip().isdigit() else None


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
        description="Linear warmup steps; left out (or null): 10, or a tenth of a run of 10 steps or fewer "
        "(train.steps, or train.lr_schedule_steps when shorter).",
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
        """A short run (`--set train.steps=5`) needs no second override: the default warmup scales.
        null is the default too, so that a later layer or --set can go back to it."""
        if isinstance(data, dict) and data.get("warmup_steps") is None:
            lengths = [_whole(data.get("steps", 200)), _whole(data.get("lr_schedule_steps"))]
            run = min((n for n in lengths if n), default=200)  # (a bad steps is refused after this)
            return {**data, "warmup_steps": default_warmup(run)}
        return data

    @model_validator(mode="after")
    def _cross_fields(self) -> TrainConfig:
        # Checked for every run, one step long too: an explicit warmup is never longer than the run
        # (steps=1 with warmup 10 trained its one step at a tenth of lr). The default always fits.
        for key, length in (("steps", self.steps), ("lr_schedule_steps", self.lr_schedule_steps)):
            if length is not None and self.warmup_steps >= length:
                run = min(self.steps, self.lr_schedule_steps or self.steps)
                raise KeyedValueError(
                    "warmup_steps",
                    f"{self.warmup_steps} must be smaller than train.{key}={length}",
                    related=(key,),
                    hint=f"set train.warmup_steps below {length}, or leave it out (its default for "
                    f"this run: {default_warmup(run)})",
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
