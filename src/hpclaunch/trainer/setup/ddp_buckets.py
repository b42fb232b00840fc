"""The pass that settles DDP's gradient buckets before an attempt's first step.

One forward and backward pass on the attempt's first item, thrown away (no optimizer step, the RNG
restored). DDP buckets the gradients in one order for its first backward pass and rebuilds the
buckets in the order the gradients became ready, once, at the next forward. Where an element sits
in its bucket decides the order in which the ring all-reduce sums its ranks' values, and with three
ranks or more that order changes the rounding. A run that resumed at step 21 used to reduce step 21
with the first order where the uninterrupted run used the rebuilt one, and was no longer bitwise
equal to it. With this pass every attempt's first step, fresh or resumed, already runs on the
rebuilt buckets.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
from torch import nn

from ...config import RunConfig
from ...rank.dist import DistContext
from ..data.loader import micro_batches

__all__ = ["DDPBuckets"]


class DDPBuckets:
    """Settles the buckets of ``train_module``, the DDP wrapper of ``model``, once per attempt."""

    def __init__(
        self,
        cfg: RunConfig,
        ctx: DistContext,
        *,
        model: nn.Module,
        train_module: nn.Module,
        opt: torch.optim.Optimizer,
        autocast: Callable[[], AbstractContextManager[object]],
    ) -> None:
        self.cfg, self.ctx = cfg, ctx
        self.model, self.train_module, self.opt, self.autocast = model, train_module, opt, autocast
        self.settled = False

    def settle(self, item: dict[str, torch.Tensor]) -> None:
        """The pass on ``item``, the attempt's first, if not done yet (nothing without DDP over 2+ ranks)."""
        if self.settled:
            return
        self.settled = True
        if self.train_module is self.model or self.ctx.world_size < 2:
            return
        cfg, dev = self.cfg, self.ctx.device
        rng = torch.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state_all() if dev.type == "cuda" else None
        mb = micro_batches(item, dev)[0]
        with self.autocast():
            losses = mb.losses(self.train_module, cfg)
        losses.total.backward()
        self.opt.zero_grad(set_to_none=True)
        torch.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
