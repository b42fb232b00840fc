"""Taking a run up where its newest state left it, before the attempt's first step.

``Trainer.resume`` chooses the state (the memory tier's snapshot, else the newest valid disk
checkpoint, else ``train.init_from`` or the seed); this module puts a loaded state into the model,
the optimizer, the EMA, the counters and this rank's RNG (``take_up``), and writes rank 0's
``resumed`` ledger event: where from, and how long start-up took (``record_resumed``).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any, Protocol

import torch
from torch import nn

from ..rundir import RESUMED, Ledger
from .checkpoint import RANK_LOCAL, rank_local_key
from .counters import Counters
from .dist import DistContext
from .ema import EMA
from .memory_tier import TierFields
from .rank_run import RankRun
from .startup import StartupClock
from .state import restore_rng_state

__all__ = ["Loaded", "record_resumed", "take_up"]


class Loaded(Protocol):
    """What a load says of the state it filled in (``memory_tier.Restored``, ``LoadResult``)."""

    @property
    def saved_sections(self) -> set[str]: ...  # top-level keys the saved state held

    @property
    def ranks_without_rank_local(self) -> Collection[int]: ...  # ranks it held no RNG state for


def take_up(
    state: Mapping[str, Any],
    loaded: Loaded,
    ctx: DistContext,
    *,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    ema: EMA | None,
    counters: Counters,
) -> None:
    """Put ``state`` (``Trainer.app_state``'s layout, filled in by a load) into the training parts."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    counters.load(state["train"])
    if ema is not None and "ema" in loaded.saved_sections:
        ema.load_counts(state["ema"])
    elif ema is not None:  # turned on after this checkpoint was written
        ema.reset_from_model()
    if ctx.rank not in loaded.ranks_without_rank_local:
        restore_rng_state(state[RANK_LOCAL][rank_local_key(ctx.rank)], ctx.device)


def record_resumed(
    ledger: Ledger,
    run: RankRun,
    *,
    checkpoint: str | None,
    token_shards_checked: int,
    startup: StartupClock,
    tier: TierFields,
) -> None:
    """Rank 0's ``resumed`` event, in its ``ledger`` (``startup``: its contract with goodput
    accounting)."""
    cfg, ctx, counters = run.cfg, run.ctx, run.counters
    ledger.append(
        RESUMED,
        step=counters.step,
        checkpoint=checkpoint,
        world_size=ctx.world_size,
        samples_consumed=counters.samples_consumed,
        parallel=cfg.train.parallel,
        token_shards_checked=token_shards_checked,
        process_start=round(startup.process_start, 3),
        startup_s=startup.seconds(),
        **tier,
    )
