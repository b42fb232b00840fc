"""Training data on disk: validation, memory-mapped reads, sample order, and a synthetic set.

Format: ``data.token_dir`` holds ``*.npz`` shards with an ``input_ids`` array [N, text_len] of
integers; ``data.latent_dir`` holds ``*.npy`` shards [N, latent_len, latent_dim] (or
[N, latent_dim] when ``model.latent_len`` is 1) of floats. Shards pair by file stem and must agree
on N. Samples are numbered across shards in sorted stem order.

Reads are memory-mapped: ``.npy`` through ``np.load(mmap_mode="r")``; an ``.npz`` member stored
uncompressed (``np.savez``) is mapped at its offset inside the zip file (compressed members are
read into memory once).

Sample order follows the determinism rule: the data position is one integer, the number of samples
consumed by the whole run; position ``p`` is sample ``perm(seed, p // N)[p % N]``, a per-epoch
permutation. So any world size with the same global batch reads the same samples in the same order.

This module must not import torch at import time: preflight and the CLI use it.
"""

from __future__ import annotations

import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import DataError

if TYPE_CHECKING:
    from ..config import ModelConfig

TOKENS_KEY = "input_ids"
DEFAULT_SHARD_SIZE = 1024


@dataclass(frozen=True)
class ShardInfo:
    stem: str
    n: int
    token_path: Path
    latent_path: Path


@dataclass(frozen=True)
class DatasetInfo:
    num_samples: int
    shards: list[ShardInfo] = field(default_factory=list)
    fully_checked: int = 0  # shards whose values (not just headers) were checked


# ---- validation --------------------------------------------------------------------------------


def validate_dataset(
    token_dir: str | Path,
    latent_dir: str | Path,
    model_cfg: ModelConfig,
    *,
    max_shards: int | None = None,
) -> DatasetInfo:
    """Check the shard pairs against the model; raise ``DataError(where=<file or dir>)``.

    Every shard's presence, pairing, dtype and shape are checked from the array headers (cheap).
    Token values (0 <= id < vocab_size) are read for the first ``max_shards`` shards only
    (None = all): preflight samples a few, the trainer checks everything it will read.
    """
    token_dir, latent_dir = Path(token_dir), Path(latent_dir)
    tokens = _shard_files(token_dir, ".npz", "token", "data.token_dir")
    latents = _shard_files(latent_dir, ".npy", "latent", "data.latent_dir")
    for stem, path in tokens.items():
        if stem not in latents:
            raise DataError(
                f"token shard has no latent pair: {latent_dir / (stem + '.npy')} does not exist",
                where=str(path),
                hint="token and latent shards pair by file stem; add the missing shard or remove this one",
            )
    for stem, path in latents.items():
        if stem not in tokens:
            raise DataError(
                f"latent shard has no token pair: {token_dir / (stem + '.npz')} does not exist",
                where=str(path),
                hint="token and latent shards pair by file stem; add the missing shard or remove this one",
            )
    shards = []
    checked = 0
    for i, stem in enumerate(sorted(tokens)):
        ids = open_token_array(tokens[stem])
        lat = open_latent_array(latents[stem])
        _check_tokens_header(ids, tokens[stem], model_cfg)
        _check_latents_header(lat, latents[stem], model_cfg)
        if ids.shape[0] != lat.shape[0]:
            raise DataError(
                f"holds N={lat.shape[0]} samples but its token shard {tokens[stem].name} holds "
                f"N={ids.shape[0]}",
                where=str(latents[stem]),
                hint="a token shard and its latent shard must hold the same samples in the same order",
            )
        if max_shards is None or i < max_shards:
            _check_token_values(ids, tokens[stem], model_cfg)
            checked += 1
        shards.append(ShardInfo(stem, int(ids.shape[0]), tokens[stem], latents[stem]))
    return DatasetInfo(num_samples=sum(s.n for s in shards), shards=shards, fully_checked=checked)


def _shard_files(directory: Path, suffix: str, kind: str, key: str) -> dict[str, Path]:
    if not directory.is_dir():
        what = "is not a directory" if directory.exists() else "does not exist"
        raise DataError(
            f"{kind} directory {what}",
            where=str(directory),
            hint=f"set {key} to the directory of *{suffix} shards, or create one with 'hpclaunch data synth'",
        )
    files = {p.stem: p for p in sorted(directory.glob(f"*{suffix}")) if p.is_file()}
    if not files:
        raise DataError(
            f"no *{suffix} {kind} shards in this directory",
            where=str(directory),
            hint=f"{key} must hold *{suffix} shards (see 'hpclaunch data synth' for the format)",
        )
    return files


def _check_tokens_header(ids: np.ndarray, path: Path, m: ModelConfig) -> None:
    if not np.issubdtype(ids.dtype, np.integer):
        raise DataError(
            f"{TOKENS_KEY} has dtype {ids.dtype}; token ids must be integers",
            where=str(path),
            hint="store input_ids as int32 or int64",
        )
    if ids.ndim != 2 or ids.shape[1] != m.text_len:
        raise DataError(
            f"{TOKENS_KEY} has shape {list(ids.shape)}; the model wants [N, {m.text_len}] "
            f"(model.text_len={m.text_len})",
            where=str(path),
            hint="re-tokenize to model.text_len tokens per sample, or change model.text_len",
        )


def _check_latents_header(lat: np.ndarray, path: Path, m: ModelConfig) -> None:
    if not np.issubdtype(lat.dtype, np.floating):
        raise DataError(
            f"latents have dtype {lat.dtype}; latents must be floating point",
            where=str(path),
            hint="store latents as float32 (or float16/float64)",
        )
    want = f"[N, {m.latent_len}, {m.latent_dim}]" + (f" or [N, {m.latent_dim}]" if m.latent_len == 1 else "")
    ok = (lat.ndim == 3 and lat.shape[1:] == (m.latent_len, m.latent_dim)) or (
        lat.ndim == 2 and m.latent_len == 1 and lat.shape[1] == m.latent_dim
    )
    if not ok:
        raise DataError(
            f"latents have shape {list(lat.shape)}; the model wants {want} "
            f"(model.latent_len={m.latent_len}, model.latent_dim={m.latent_dim})",
            where=str(path),
            hint="re-encode the latents, or change model.latent_len / model.latent_dim",
        )


def _check_token_values(ids: np.ndarray, path: Path, m: ModelConfig, chunk: int = 1 << 16) -> None:
    for start in range(0, ids.shape[0], chunk):
        block = np.asarray(ids[start : start + chunk])
        if block.size == 0:
            continue
        lo, hi = int(block.min()), int(block.max())
        if lo >= 0 and hi < m.vocab_size:
            continue
        bad = block >= m.vocab_size if hi >= m.vocab_size else block < 0
        row, col = (int(x) for x in np.argwhere(bad)[0])
        value = int(block[row, col])
        problem = "is negative" if value < 0 else f">= model.vocab_size={m.vocab_size}"
        raise DataError(
            f"{TOKENS_KEY} holds id {value} at sample {start + row}, position {col}: {problem} "
            f"(ids must be 0..{m.vocab_size - 1})",
            where=str(path),
            hint="set model.vocab_size to the tokenizer's vocabulary size, or fix the tokenization",
        )


# ---- memory-mapped reading ---------------------------------------------------------------------


def open_latent_array(path: Path) -> np.ndarray:
    try:
        return np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise DataError(f"not a readable .npy array ({e})", where=str(path)) from None


def open_token_array(path: Path) -> np.ndarray:
    """``input_ids`` of an .npz shard, memory-mapped when the member is stored uncompressed."""
    try:
        with zipfile.ZipFile(path) as zf:
            names = zf.namelist()
            member = TOKENS_KEY + ".npy"
            if member not in names:
                keys = ", ".join(n.removesuffix(".npy") for n in names) or "none"
                raise DataError(
                    f"has no {TOKENS_KEY} array (arrays: {keys})",
                    where=str(path),
                    hint=f"save token shards with np.savez(path, {TOKENS_KEY}=ids)",
                )
            info = zf.getinfo(member)
            if info.compress_type == zipfile.ZIP_STORED:
                mapped = _map_stored_member(path, info)
                if mapped is not None:
                    return mapped
            with zf.open(member) as f:
                return np.lib.format.read_array(f, allow_pickle=False)
    except (zipfile.BadZipFile, ValueError, OSError, EOFError) as e:
        raise DataError(f"not a readable .npz archive ({e})", where=str(path)) from None


def _map_stored_member(path: Path, info: zipfile.ZipInfo) -> np.ndarray | None:
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        local = f.read(30)
        if local[:4] != b"PK\x03\x04":
            return None
        name_len = int.from_bytes(local[26:28], "little")
        extra_len = int.from_bytes(local[28:30], "little")
        f.seek(info.header_offset + 30 + name_len + extra_len)
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
        elif version in ((2, 0), (3, 0)):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
        else:
            return None
        if dtype.hasobject:
            return None
        offset = f.tell()
    if int(np.prod(shape)) == 0:
        return np.zeros(shape, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape, order="F" if fortran else "C")


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


# ---- a small learnable dataset -----------------------------------------------------------------


def synth_dataset(
    out_dir: str | Path,
    *,
    samples: int,
    seed: int,
    model_cfg: ModelConfig,
    shard_size: int = DEFAULT_SHARD_SIZE,
) -> DatasetInfo:
    """Write ``OUT/tokens/shard_NNNNN.npz`` + ``OUT/latents/shard_NNNNN.npy``; return their info.

    Learnable on purpose, so that both losses fall in a short run:
    - text: each sample repeats a short motif (one of a few templates, period 2..8) from a random
      phase, with 5 % of positions replaced by random ids; a masked token is mostly predictable
      from its unmasked neighbours one period away;
    - latents: a deterministic function of the tokens: latent vector j is a fixed random
      projection of the mean embedding of its chunk of text positions, squashed by tanh and
      scaled to unit variance. Given the text, the latents carry no extra randomness.
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
    chunks = np.stack([emb[:, min(a, m.text_len - 1) : b].mean(axis=1) for a, b in bounds], axis=1)
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


def _save_atomic(path: Path, write: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        write(f)
    tmp.replace(path)
