"""What the trainer reads: samples across memory-mapped shards, the sample order, the validation split.

Sample order follows the determinism rule: the data position is one integer, the number of samples
consumed by the whole run; position ``p`` is training sample ``perm(seed, p // N)[p % N]``, a
per-epoch permutation of the N training samples. So any world size with the same global batch
reads the same samples in the same order. ``data.val_fraction`` holds out a fixed set of samples
(chosen by the seed alone); the permutation then runs over the others. The on-disk format and its
validation live in ``hpclaunch.shards``; feeding batches to the loop lives in ``loader``.

Torch-free (numpy only): the CLI's ``sample`` command and preflight read samples through it too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ...shards.format import DatasetInfo, open_latent_array, open_token_array

if TYPE_CHECKING:
    from ...config import ModelConfig


class ShardedDataset:
    """Random access to sample i (0 <= i < num_samples) across the shard pairs of ``info``.

    Shards stay memory-mapped: a read touches only the rows it asks for, so a dataset larger than
    memory costs nothing to open and every DataLoader worker shares the page cache.
    """

    def __init__(self, info: DatasetInfo, model_cfg: ModelConfig):
        self.info = info
        self.num_samples = info.num_samples
        self._tokens = [open_token_array(s.token_path) for s in info.shards]
        self._latents = [
            open_latent_array(s.latent_path).reshape(s.n, model_cfg.latent_len, model_cfg.latent_dim)
            for s in info.shards
        ]
        self._starts = np.cumsum([0] + [s.n for s in info.shards])
        self.text_len = model_cfg.text_len
        self.latent_shape = (model_cfg.latent_len, model_cfg.latent_dim)
        self.vocab_size = model_cfg.vocab_size

    def __len__(self) -> int:
        return self.num_samples

    def get(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(input_ids int64 [B, text_len], latents float32 [B, latent_len, latent_dim])."""
        indices = np.asarray(indices, dtype=np.int64)
        ids = np.empty((len(indices), self.text_len), dtype=np.int64)
        lat = np.empty((len(indices), *self.latent_shape), dtype=np.float32)
        shard = np.searchsorted(self._starts, indices, side="right") - 1
        for s in np.unique(shard):
            rows = np.nonzero(shard == s)[0]
            local = indices[rows] - self._starts[s]
            # One fancy-index read per shard (sorted rows read the file front to back).
            order = np.argsort(local, kind="stable")
            ids[rows[order]] = self._tokens[s][local[order]]
            lat[rows[order]] = self._latents[s][local[order]]
        return ids, lat

    def id_problem(self, ids: np.ndarray, indices: np.ndarray) -> str | None:
        """None when every id read for ``indices`` is in 0..vocab_size-1; else where the first bad
        one is. The start-up check vouched for the shards, but a shard rewritten while the run
        trains is seen here, by the batch, before the model indexes out of range (a crash that
        would be retried) instead of at the next start's check."""
        if ids.size == 0 or (int(ids.min()) >= 0 and int(ids.max()) < self.vocab_size):
            return None
        row, col = (int(x) for x in np.argwhere((ids < 0) | (ids >= self.vocab_size))[0])
        index = int(indices[row])
        shard = int(np.searchsorted(self._starts, index, side="right") - 1)
        return (
            f"{self.info.shards[shard].token_path}: id {int(ids[row, col])} at sample "
            f"{index - int(self._starts[shard])}, position {col} is outside 0..{self.vocab_size - 1} "
            "(the shard changed after the run's start-up check)"
        )


class SampleOrder:
    """Global position -> sample index: a fresh permutation of the training samples per epoch.

    ``subset`` (sorted sample indices) restricts training to those samples (the rest are held out
    for validation); without it every sample trains, in exactly the order earlier versions used.
    """

    def __init__(self, num_samples: int, seed: int, subset: np.ndarray | None = None):
        self.subset = subset
        self.n = len(subset) if subset is not None else num_samples
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
        return self.subset[out] if self.subset is not None else out


def holdout_split(num_samples: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(training indices, validation indices), both sorted: ``round(fraction * N)`` samples (at
    least one) chosen by ``seed`` alone, so every attempt and every world size holds out the same."""
    k = min(num_samples - 1, max(1, round(fraction * num_samples)))
    rng = np.random.Generator(np.random.PCG64([seed, 0x7A11D]))
    val = np.sort(rng.permutation(num_samples)[:k]).astype(np.int64)
    keep = np.ones(num_samples, dtype=bool)
    keep[val] = False
    return np.nonzero(keep)[0].astype(np.int64), val


def text_mask(ids: np.ndarray, pad_id: int | None) -> np.ndarray | None:
    """True where a token is text (not padding); None when the data has no pad id."""
    return None if pad_id is None else ids != pad_id
