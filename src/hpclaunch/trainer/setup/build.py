"""Set-up pieces of the trainer that are not the loop: the checked datasets, the wrapped model, the
optimizer and the EMA (the checkpointer and memory tier are the run's: ``rank.tiers``).

Data: rank 0 validates the training shards (and the validation shards, when configured) and the
other ranks get its verdict as JSON (no rank trains on bad data, no pickles cross ranks). The
token-range check reads only shards no check record vouches for (``shards.checked``).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...config import RunConfig, TrainConfig
from ...errors import DataError, FilesystemError
from ...rank.dist import DistContext, broadcast_json
from ...shards import DatasetInfo, validate_dataset
from ...shards import checked as check_record
from ..data.dataset import SampleOrder, ShardedDataset, holdout_split
from ..model.ema import EMA
from ..model.mmdit_diffusion import build_model
from ..state import init_adamw_state
from .parallel import wants_bf16, wrap_model


@dataclass
class ModelParts:
    model: torch.nn.Module  # the bare model (under FSDP: the sharded root itself)
    train_module: torch.nn.Module  # what the training step calls (the DDP wrapper, or the model)
    params: list[torch.nn.Parameter]  # trainable
    opt: torch.optim.AdamW
    ema: EMA | None
    autocast: Any  # a context manager factory
    sharded: bool


def build_model_parts(cfg: RunConfig, ctx: DistContext, *, lr: float) -> ModelParts:
    """The model (a pure function of the seed), wrapped for DDP/FSDP, with AdamW and the EMA."""
    t = cfg.train
    sharded = t.parallel == "fsdp" and ctx.world_size > 1  # (one rank: no wrapper, see wrap_model)
    model = build_model(cfg.model, seed=t.seed)
    if not sharded:
        model = model.to(ctx.device)  # FSDP moves only its shards to the device
    if t.mode == "l2t":
        model.latent_head.requires_grad_(False)
    elif t.mode == "t2l":
        model.text_head.requires_grad_(False)
    train_module = wrap_model(model, cfg, ctx)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = build_optimizer(params, t, lr)
    init_adamw_state(opt)
    ema = EMA(model, t.ema_decay) if t.ema_decay else None
    # FSDP's mixed-precision policy casts parameters itself; DDP computes in bf16 by autocast.
    autocast: Any = nullcontext
    if wants_bf16(cfg, ctx.device) and not sharded:
        autocast = lambda: torch.autocast(device_type=ctx.device.type, dtype=torch.bfloat16)  # noqa: E731
    return ModelParts(model, train_module, params, opt, ema, autocast, sharded)


@dataclass
class DataParts:
    train: ShardedDataset
    order: SampleOrder
    val: ShardedDataset | None  # the dataset validation samples come from
    val_indices: np.ndarray | None  # the validation samples in it, in evaluation order
    checked_shards: int  # token shards whose values rank 0 read this start


def _checked(token_dir: str, latent_dir: str, cfg: RunConfig, run_dir: Path | None) -> DatasetInfo:
    vocab = cfg.model.vocab_size
    good = check_record.known_good(token_dir, vocab, run_dir)
    info = validate_dataset(token_dir, latent_dir, cfg.model, known_good=good)
    if info.fully_checked:
        check_record.record(info, token_dir, vocab, run_dir)
    return info


def _validate_all(cfg: RunConfig, run_dir: Path | None) -> dict[str, Any]:
    d = cfg.data
    try:
        out: dict[str, Any] = {"train": _checked(d.token_dir, d.latent_dir, cfg, run_dir).to_json()}
        if d.val_token_dir and d.val_latent_dir:
            out["val"] = _checked(d.val_token_dir, d.val_latent_dir, cfg, run_dir).to_json()
        return out
    except DataError as e:
        return {"error": [e.message, e.where, e.hint]}
    except FilesystemError as e:
        return {"error": [e.message, e.where, e.hint], "filesystem": True}


def load_data(cfg: RunConfig, ctx: DistContext, run_dir: Path | None) -> DataParts:
    """The datasets, sample order and validation set of this run (rank 0 checks, all ranks agree)."""
    payload: dict[str, Any] = _validate_all(cfg, run_dir) if ctx.is_main else {}
    if ctx.initialized:
        payload = broadcast_json(payload, ctx.host_group(), is_source=ctx.is_main)
    if "error" in payload:
        message, where, hint = payload["error"]
        raise (FilesystemError if payload.get("filesystem") else DataError)(message, where=where, hint=hint)
    info = DatasetInfo.from_json(payload["train"])
    train = ShardedDataset(info, cfg.model)
    d, seed = cfg.data, cfg.train.seed
    val: ShardedDataset | None = None
    val_indices = None
    subset = None
    if "val" in payload:
        val = ShardedDataset(DatasetInfo.from_json(payload["val"]), cfg.model)
        val_indices = np.arange(val.num_samples, dtype=np.int64)
    elif d.val_fraction > 0:
        if info.num_samples < 2:
            raise DataError(
                f"data.val_fraction {d.val_fraction} needs at least 2 samples, the data has {info.num_samples}",
                where=d.token_dir,
            )
        subset, val_indices = holdout_split(info.num_samples, d.val_fraction, seed)
        val = train
    return DataParts(
        train=train,
        order=SampleOrder(info.num_samples, seed, subset),
        val=val,
        val_indices=val_indices,
        checked_shards=info.fully_checked,
    )


def build_optimizer(params: list[torch.nn.Parameter], t: TrainConfig, lr: float) -> torch.optim.AdamW:
    """AdamW; weight decay on tensors of two or more dimensions only (not on biases and gains).

    The fused implementation: one kernel per parameter group and device over every tensor (DTensor
    shards included), where the default would dispatch a dozen foreach ops, or on the CPU a dozen
    ops and a host read of the step count per parameter. It is elementwise, so deterministic."""
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=(t.betas[0], t.betas[1]),
        fused=True,
    )
