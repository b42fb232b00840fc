"""What the trainer reads: random access to samples across shards, and the sample order.

Sample order follows the determinism rule: the data position is one integer, the number of samples
consumed by the whole run; position ``p`` is sample ``perm(seed, p // N)[p % N]``, a per-epoch
permutation. So any world size with the same global batch reads the same samples in the same order.
The on-disk format and its validation live in ``hpclaunch.shards``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..shards.format import DatasetInfo, open_latent_array, open_token_array

if TYPE_CHECKING:
    from ..config import ModelConfig


class ShardedDataset:
    """Random access to sample i (0 <= i < num_samples) across the shard pairs of ``info``."""

    def __init__(self, info: DatasetInfo, model_cfg: ModelConfig):
        self.info = info
        self.num_samples = info.num_samples
        self._tokens = [open_token_array(s.token_path) for s in info.shards]
        self._latents = [
            open_latent_array(s.latent_path).reshape(s.n, model_cfg.latent_len, model_cfg.latent_dim)
            for s in info.shards
        ]
        self._starts = np.cumsum([0] + [s.n for s in info.shards])

    def __len__(self) -> int:
        return self.num_samples

    def get(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(input_ids int64 [B, text_len], latents float32 [B, latent_len, latent_dim])."""
        shard = np.searchsorted(self._starts, indices, side="right") - 1
        local = indices - self._starts[shard]
        ids = np.stack([self._tokens[s][i] for s, i in zip(shard, local, strict=True)]).astype(np.int64)
        lat = np.stack([self._latents[s][i] for s, i in zip(shard, local, strict=True)]).astype(np.float32)
        return ids, lat


class SampleOrder:
    """Global position -> sample index: a fresh permutation of all samples per epoch."""

    def __init__(self, num_samples: int, seed: int):
        self.n = num_samples
        self.seed = seed
        self._epoch = -1
        self._perm = np.empty(0, dtype=np.int64)

    def permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            rng = np.random.Generator(np.random.PCG64([self.seed, epoch, 0x5A4D]))
            self._perm = rng.permutation(self.n).astype(np.int64)
            self._epoch = epoch
        return self._perm

    def indices(self, start: int, count: int) -> np.ndarray:
        """Sample indices at global positions ``start .. start+count-1``."""
        positions = np.arange(start, start + count, dtype=np.int64)
        epochs, offsets = np.divmod(positions, self.n)
        out = np.empty(count, dtype=np.int64)
        for epoch in np.unique(epochs):
            sel = epochs == epoch
            out[sel] = self.permutation(int(epoch))[offsets[sel]]
        return out
