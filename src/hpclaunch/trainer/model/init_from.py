"""Start a run from another run's weights (``train.init_from``): weights only, through DCP.

Called by ``Trainer.resume`` when the run has no checkpoint of its own yet (so a run that has one
resumes from it and never re-initializes). What is loaded: the source's model weights, or its EMA
weights (``train.init_from_ema``), into the model; this run's EMA, when it has one, starts from the
source's EMA (or from the loaded model when the source has none, or when the model itself was
loaded from the EMA) with its update count at 0. The optimizer stays fresh, the step and the data
position stay 0. DCP reshards on load, so the source may have been written by any number of ranks
under DDP or FSDP, and this run may use either.

Collective (every rank calls it). Rank 0 chooses the checkpoint (``init_source.resolve``: verified
against its manifest, read-only) and every rank gets the choice as JSON; every rank reads the DCP
metadata and compares each tensor's shape before anything is loaded, so a mismatch is the same
one-line error on every rank (exit 2, nothing written: no step has run and nothing was saved).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict, cast

import torch

from ...errors import HpclaunchError, TrainingError
from ...rank.checkpoint.reader import dcp_load, read_metadata_everywhere
from ...rank.dist import DistContext, broadcast_json
from ...rank.tensors import local
from ...rundir import INITIALIZED, Ledger
from ...rundir.checkpoint_manifest import CheckpointInfo
from ...rundir.init_source import resolve, shape_differences
from .ema import EMA, clean_name

MAX_SHOWN = 4


class InitFromError(TrainingError):
    """``train.init_from`` cannot start this run (bad input: exit 2, never retried)."""

    exit_code = 2


class _Choice(TypedDict, total=False):
    """Rank 0's word to every rank (broadcast as JSON): the checkpoint to load
    (``InitSourceJSON`` and its manifest), or why none."""

    path: str
    step: int
    run: str | None
    manifest: Any  # CheckpointInfo.manifest, as rank.checkpoint types it
    error: str


@dataclass(frozen=True)
class Initialized:
    path: str
    step: int
    run: str | None
    ema: bool  # the model's weights are the source's EMA
    ema_from: str | None  # this run's EMA: "checkpoint" (the source's EMA), "model", or None (no EMA)

    def describe(self) -> str:
        what = "EMA weights" if self.ema else "weights"
        return f"{what} of {self.run or self.path} step {self.step}"


def init_weights(
    cfg: Any, ctx: DistContext, model: torch.nn.Module, ema: EMA | None, ledger: Ledger | None
) -> Initialized:
    """Load ``cfg.train.init_from`` into ``model`` (and ``ema``); rank 0 records ``initialized``."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    t = cfg.train
    pg = ctx.host_group() if ctx.initialized else None
    choice: _Choice = {}
    if ctx.is_main:
        try:
            source = resolve(t.init_from)
            choice = {**source.to_json(), "manifest": source.manifest}
        except HpclaunchError as e:  # reported on every rank below, as the same error
            choice = {"error": e.one_line()}
    if pg is not None:
        choice = broadcast_json(choice, pg, is_source=ctx.is_main)
    if choice.get("error"):
        raise InitFromError(choice["error"], hint="fix train.init_from (see 'hpclaunch config show')")
    path = Path(choice["path"])
    info = CheckpointInfo(step=int(choice["step"]), path=path, manifest=choice["manifest"])
    saved = read_metadata_everywhere(path, pg).state_dict_metadata

    model_sd = get_model_state_dict(model)
    names = [clean_name(n) for n, _ in model.named_parameters()]
    source_ema = any(k.startswith("ema.weights.") for k in saved)
    if t.init_from_ema and not source_ema:
        raise InitFromError(
            f"{path} has no EMA weights (it was trained without train.ema_decay)",
            where="train.init_from",
            hint="set train.init_from_ema: false to start from its weights",
        )
    state: dict[str, Any] = {"model": model_sd}
    shadow: dict[str, torch.Tensor] = {}
    if source_ema and (t.init_from_ema or ema is not None):
        shadow = {n: torch.empty_like(cast(torch.Tensor, model_sd[n])) for n in names}
        state["ema"] = {"weights": shadow}
    _refuse_other_shapes(state, saved, info, cfg)
    dcp_load(info, state, pg)

    with torch.no_grad():
        if t.init_from_ema:
            set_model_state_dict(model, {**model_sd, **shadow})
        else:
            set_model_state_dict(model, model_sd)
        ema_from = None
        if ema is not None:
            if shadow and not t.init_from_ema:
                for s, name in zip(ema.shadow, ema.names, strict=True):
                    local(s).copy_(local(shadow[name]))
                ema.updates = 0
                ema_from = "checkpoint"
            else:
                ema.reset_from_model()
                ema_from = "model"
    done = Initialized(str(path), info.step, choice.get("run"), bool(t.init_from_ema), ema_from)
    if ledger is not None:
        ledger.append(
            INITIALIZED,
            init_from=str(t.init_from),
            checkpoint=done.path,
            run=done.run,
            step=done.step,
            ema=done.ema,
            ema_from=ema_from,
            source_world_size=info.manifest.get("world_size"),
            source_parallel=(info.manifest.get("extra") or {}).get("parallel"),
        )
    return done


def _refuse_other_shapes(
    state: dict[str, Any], saved: dict[str, Any], info: CheckpointInfo, cfg: Any
) -> None:
    """One line naming the tensors whose shapes differ (and those missing on either side)."""
    problems: list[str] = []
    wanted = set()
    for section, tensors in (
        ("model", state["model"]),
        ("ema.weights", state.get("ema", {}).get("weights", {})),
    ):
        for name, tensor in tensors.items():
            key = f"{section}.{name}"
            wanted.add(key)
            meta = saved.get(key)
            if meta is None:
                problems.append(f"{key} missing there")
            elif hasattr(meta, "size") and tuple(meta.size) != tuple(tensor.shape):
                problems.append(f"{key} {list(meta.size)} there, {list(tensor.shape)} here")
    extra = sorted(k for k in saved if k.startswith("model.") and k not in wanted)
    problems += [f"{k} missing here" for k in extra]
    if not problems:
        return
    shown = "; ".join(problems[:MAX_SHOWN]) + (
        f"; +{len(problems) - MAX_SHOWN} more" if len(problems) > MAX_SHOWN else ""
    )
    settings = shape_differences(info.manifest.get("extra", {}).get("model") or {}, cfg)
    why = f" ({'; '.join(settings)})" if settings else ""
    raise InitFromError(
        f"{info.path} holds another model shape{why}: {shown}",
        where="train.init_from",
        hint="use the same model.* shape settings as the run you start from",
    )
