"""This rank's share of every step, and the items that carry it from the current step on.

``StepFeed`` fixes the shape of a rank's step (``per_rank`` samples of the global batch, in
``accum`` micro-batches of ``micro``) before the data is loaded, and hands the loop its items from
the data: ``step_batches`` from the step after ``counters.step`` to the end of the run, and
``loader``, which reads them through the DataLoader (``loader.make_loader``).
"""

from __future__ import annotations

from collections.abc import Iterator

from torch import Tensor

from ...config import RunConfig
from ...rank.dist import DistContext
from ..counters import Counters
from ..setup.build import DataParts
from .loader import StepBatches, StepPlan, make_loader

__all__ = ["StepFeed"]


class StepFeed:
    """The shape of this rank's step and its items from the current step on."""

    def __init__(self, cfg: RunConfig, ctx: DistContext, counters: Counters) -> None:
        self.cfg, self.ctx, self.counters = cfg, ctx, counters
        self.per_rank = cfg.train.global_batch // ctx.world_size
        self.micro = min(cfg.micro_batch, self.per_rank)
        if self.per_rank % self.micro:
            self.micro = self.per_rank  # a resume on another rank count: no accumulation then
        self.accum = self.per_rank // self.micro

    def step_batches(self, data: DataParts) -> StepBatches:
        """This rank's items of ``data`` from the current step to the end of the run."""
        cfg, c = self.cfg, self.counters
        plan = StepPlan(
            seed=cfg.train.seed, first_step=c.step + 1, first_position=c.samples_consumed,
            steps=max(0, cfg.train.steps - c.step), global_batch=cfg.train.global_batch,
            rank=self.ctx.rank, per_rank=self.per_rank, micro=self.micro, pad_id=cfg.data.pad_id,
        )  # fmt: skip
        return StepBatches(data.train, data.order, plan)

    def loader(self, data: DataParts) -> Iterator[dict[str, Tensor]]:
        """The items of ``step_batches`` through the DataLoader (workers prefetch; pinned on CUDA)."""
        d = self.cfg.data
        cuda = self.ctx.device.type == "cuda"
        return make_loader(
            self.step_batches(data),
            num_workers=d.num_workers,
            prefetch_factor=d.prefetch_factor,
            pin_memory=cuda,
        )
