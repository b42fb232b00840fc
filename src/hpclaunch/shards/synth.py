"""A small learnable dataset in the trainer's format (``hpclaunch data synth``)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .format import DEFAULT_SHARD_SIZE, TOKENS_KEY, DatasetInfo, ShardInfo

if TYPE_CHECKING:
    from ..config import ModelConfig


def synth_dataset(
    out_dir: str | Path,
    *,
    samples: int,
    seed: int,
    model_cfg: ModelConfig,
    shard_size: int = DEFAULT_SHARD_SIZE,
    pad_id: int | None = None,
) -> DatasetInfo:
    """Write ``OUT/tokens/shard_NNNNN.npz`` + ``OUT/latents/shard_NNNNN.npy``; return their info.

    Learnable on purpose, so that both losses fall in a short run:
    - text: each sample repeats a short motif (one of a few templates, period 2..8) from a random
      phase, with 5 % of positions replaced by random ids; a masked token is mostly predictable
      from its unmasked neighbours one period away;
    - latents: a deterministic function of the tokens: latent vector j is a fixed random
      projection of the mean embedding of its chunk of text positions, squashed by tanh and
      scaled to unit variance. Given the text, the latents carry no extra randomness.

    ``pad_id`` (variable-length text): sample i keeps its first ``L_i`` tokens, ``L_i`` uniform in
    ``[text_len // 4, text_len]`` (at least 1), and the rest is ``pad_id``; no real token equals
    ``pad_id``; a latent chunk averages the real tokens of its chunk (all real tokens when its chunk
    is padding). Without ``pad_id`` the output is exactly that of earlier versions.
    """
    if samples < 1:
        raise ValueError("samples must be at least 1")
    if shard_size < 1:
        raise ValueError("shard_size must be at least 1")
    m = model_cfg
    rng = np.random.Generator(np.random.PCG64([seed, 0x5EED]))
    n_templates = 8
    periods = rng.integers(2, 9, size=n_templates)
    motifs = [rng.integers(0, m.vocab_size, size=int(p)) for p in periods]
    which = rng.integers(0, n_templates, size=samples)
    phase = rng.integers(0, 8, size=samples)
    pos = np.arange(m.text_len)
    ids = np.empty((samples, m.text_len), dtype=np.int32)
    for t, motif in enumerate(motifs):
        rows = np.nonzero(which == t)[0]
        ids[rows] = motif[(pos[None, :] + phase[rows, None]) % len(motif)]
    noisy = rng.random((samples, m.text_len)) < 0.05
    ids[noisy] = rng.integers(0, m.vocab_size, size=int(noisy.sum()))
    real = None
    if pad_id is not None:
        if not 0 <= pad_id < m.vocab_size:
            raise ValueError(f"pad_id {pad_id} is outside the vocabulary 0..{m.vocab_size - 1}")
        ids[ids == pad_id] = (pad_id + 1) % m.vocab_size  # no real token looks like padding
        lengths = rng.integers(max(1, m.text_len // 4), m.text_len + 1, size=samples)
        real = np.arange(m.text_len)[None, :] < lengths[:, None]

    emb_dim = 32
    table = rng.standard_normal((m.vocab_size, emb_dim)).astype(np.float32)
    proj = (rng.standard_normal((emb_dim, m.latent_dim)) / np.sqrt(emb_dim)).astype(np.float32)
    bounds = [
        (
            j * m.text_len // m.latent_len,
            max((j + 1) * m.text_len // m.latent_len, j * m.text_len // m.latent_len + 1),
        )
        for j in range(m.latent_len)
    ]
    emb = table[ids]  # [N, L, E]
    if real is None:
        chunks = np.stack([emb[:, min(a, m.text_len - 1) : b].mean(axis=1) for a, b in bounds], axis=1)
    else:
        chunks = _masked_chunk_means(emb, real, bounds)
        ids[~real] = pad_id  # type: ignore[assignment]
    latents = np.tanh(chunks @ proj * 2.0)
    latents = ((latents - latents.mean()) / (latents.std() + 1e-6)).astype(np.float32)

    out = Path(out_dir)
    (out / "tokens").mkdir(parents=True, exist_ok=True)
    (out / "latents").mkdir(parents=True, exist_ok=True)
    shards = []
    for k, start in enumerate(range(0, samples, shard_size)):
        stop = min(start + shard_size, samples)
        stem = f"shard_{k:05d}"
        token_path = out / "tokens" / f"{stem}.npz"
        latent_path = out / "latents" / f"{stem}.npy"
        _save_atomic(token_path, lambda f, a=ids[start:stop]: np.savez(f, **{TOKENS_KEY: a}))
        _save_atomic(latent_path, lambda f, a=latents[start:stop]: np.save(f, a))
        shards.append(ShardInfo(stem, stop - start, token_path, latent_path))
    return DatasetInfo(num_samples=samples, shards=shards, fully_checked=len(shards))


def _masked_chunk_means(emb: np.ndarray, real: np.ndarray, bounds: list[tuple[int, int]]) -> np.ndarray:
    """Mean embedding of the real tokens in each chunk (all real tokens of the sample when none)."""
    w = real.astype(np.float32)[:, :, None]
    overall = (emb * w).sum(axis=1) / np.maximum(w.sum(axis=1), 1.0)
    out = []
    for a, b in bounds:
        a = min(a, emb.shape[1] - 1)
        n = w[:, a:b].sum(axis=1)
        mean = (emb[:, a:b] * w[:, a:b]).sum(axis=1) / np.maximum(n, 1.0)
        out.append(np.where(n > 0, mean, overall))
    return np.stack(out, axis=1)


def _save_atomic(path: Path, write: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        write(f)
    tmp.replace(path)
