"""Validation: the losses of a fixed set of held-out samples, every ``train.eval_every`` steps.

The set is the first ``train.eval_samples`` samples of the validation data (``data.val_*_dir``)
or of the held-out samples (``data.val_fraction``), and their random draws are fixed too: drawn
for "step 0" (training steps start at 1) at each sample's index in the set. So every evaluation of
the same weights gives the same numbers, on every attempt; a resumed run at the same world size
reports bitwise what the uninterrupted one did.

Ranks take the set strided and all run the same number of forward passes (FSDP gathers inside
every forward; a rank with fewer samples runs its last pass on a dummy batch it ignores). Sums and
counts (not means) are all-reduced, so the loss is the mean over all scored tokens / elements of
the set whatever the world size; only the summation order changes with it. With ``train.ema_decay``
the average weights are evaluated.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..config import RunConfig
from .data.dataset import ShardedDataset, text_mask
from .data.loader import eval_positions
from .model.objective import Objective, compute_losses, draw

EVAL_STEP = 0  # draws of the evaluation set: a step number training never uses


class Evaluator:
    def __init__(
        self,
        cfg: RunConfig,
        dataset: ShardedDataset,
        indices: np.ndarray,
        *,
        rank: int,
        world: int,
        batch: int,
        device: torch.device,
    ):
        self.cfg = cfg
        self.dataset = dataset
        self.indices = indices[: cfg.train.eval_samples]
        self.device = device
        self.batch = max(1, batch)
        self.mine, share = eval_positions(len(self.indices), rank, world)
        self.passes = -(-share // self.batch)
        self.world = world

    def run(self, model: torch.nn.Module, *, autocast: Any) -> dict[str, float | None]:
        """Validation losses of ``model`` (collective when distributed)."""
        sums = torch.zeros(4, dtype=torch.float64, device=self.device)  # text sum/count, latent sum/count
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                for i in range(self.passes):
                    chunk = self.mine[i * self.batch : (i + 1) * self.batch]
                    real = bool(chunk)
                    part = self._losses(model, chunk or [0], autocast)
                    if real:
                        sums += part
        finally:
            model.train(was_training)
        if self.world > 1 and dist.is_initialized():
            dist.all_reduce(sums)
        text_sum, text_n, lat_sum, lat_n = sums.tolist()
        text = text_sum / text_n if text_n else None
        latent = lat_sum / lat_n if lat_n else None
        t = self.cfg.train
        total = (t.text_weight * (text or 0.0)) + (t.latent_weight * (latent or 0.0))
        return {"val_loss": total, "val_text_loss": text, "val_latent_loss": latent}

    def _losses(self, model: torch.nn.Module, positions: list[int], autocast: Any) -> torch.Tensor:
        m, t = self.cfg.model, self.cfg.train
        ids, lat = self.dataset.get(self.indices[positions])
        d = draw(t.seed, EVAL_STEP, positions, m.text_len, (m.latent_len, m.latent_dim))
        dev = self.device
        mask = text_mask(ids, self.cfg.data.pad_id)
        d.t_text, d.t_latent = d.t_text.to(dev), d.t_latent.to(dev)
        d.mask_keys, d.noise = d.mask_keys.to(dev), d.noise.to(dev)
        with autocast():
            losses = compute_losses(
                model,
                torch.from_numpy(ids).to(dev),
                torch.from_numpy(lat).to(dev),
                d,
                Objective.of(self.cfg),
                text_mask=None if mask is None else torch.from_numpy(mask).to(dev),
            )
        zero = torch.zeros((), dtype=torch.float64, device=dev)

        def f(x: Any) -> torch.Tensor:
            if x is None:
                return zero
            return (
                x.double()
                if isinstance(x, torch.Tensor)
                else torch.tensor(x, dtype=torch.float64, device=dev)
            )

        return torch.stack(
            [f(losses.text_sum), f(losses.text_count), f(losses.latent_sum), f(losses.latent_count)]
        )
