"""The training data's on-disk format: shard discovery, validation and memory-mapped reading.

Format: ``data.token_dir`` holds ``*.npz`` shards with an ``input_ids`` array [N, text_len] of
integers; ``data.latent_dir`` holds ``*.npy`` shards [N, latent_len, latent_dim] (or
[N, latent_dim] when ``model.latent_len`` is 1) of floats. Shards pair by file stem and must agree
on N. Samples are numbered across shards in sorted stem order.

Reads are memory-mapped: ``.npy`` through ``np.load(mmap_mode="r")``; an ``.npz`` member stored
uncompressed (``np.savez``) is mapped at its offset inside the zip file (compressed members are
read into memory once).

Torch-free: preflight, the CLI (``data synth``) and the trainer all use it.
"""

from __future__ import annotations

import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..errors import DataError, FilesystemError
from ..fsutil import TRANSIENT_ERRNOS, retry_transient

if TYPE_CHECKING:
    import numpy.typing as npt

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
    known_good: int = 0  # shards whose values a check record vouched for (not read again)

    def to_json(self) -> dict[str, object]:
        return {
            "num_samples": self.num_samples,
            "shards": [[s.stem, s.n, str(s.token_path), str(s.latent_path)] for s in self.shards],
            "fully_checked": self.fully_checked,
            "known_good": self.known_good,
        }

    @classmethod
    def from_json(cls, data: dict[str, object]) -> DatasetInfo:
        shards = [ShardInfo(str(a), int(b), Path(c), Path(d)) for a, b, c, d in data["shards"]]  # type: ignore[attr-defined]
        return cls(
            num_samples=int(data["num_samples"]),  # type: ignore[call-overload]
            shards=shards,
            fully_checked=int(data["fully_checked"]),  # type: ignore[call-overload]
            known_good=int(data.get("known_good", 0)),  # type: ignore[call-overload]
        )


# ---- validation --------------------------------------------------------------------------------


def validate_dataset(
    token_dir: str | Path,
    latent_dir: str | Path,
    model_cfg: ModelConfig,
    *,
    max_shards: int | None = None,
    known_good: set[str] | None = None,
) -> DatasetInfo:
    """Check the shard pairs against the model; raise ``DataError(where=<file or dir>)``.

    Every shard's presence, pairing, dtype and shape are checked from the array headers (cheap).
    Token values (0 <= id < vocab_size) are read for the first ``max_shards`` shards only
    (None = all): preflight samples a few, the trainer checks everything it will read, except
    the token files named in ``known_good`` (a check record vouches for them: ``shards.checked``).
    """
    token_dir, latent_dir = Path(token_dir), Path(latent_dir)
    tokens = _shard_files(token_dir, ".npz", "token", "data.token_dir")
    latents = _shard_files(latent_dir, ".npy", "latent", "data.latent_dir")
    pairings = (
        ("token", tokens, "latent", latents, latent_dir, ".npy"),
        ("latent", latents, "token", tokens, token_dir, ".npz"),
    )
    for kind, own, other_kind, others, other_dir, other_ext in pairings:
        for stem, path in own.items():
            if stem not in others:
                raise DataError(
                    f"{kind} shard has no {other_kind} pair: {other_dir / (stem + other_ext)} does not exist",
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
        vouched = known_good is not None and str(tokens[stem]) in known_good
        if (max_shards is None or i < max_shards) and not vouched:
            _check_token_values(ids, tokens[stem], model_cfg)
            checked += 1
        shards.append(ShardInfo(stem, int(ids.shape[0]), tokens[stem], latents[stem]))
    good = sum(1 for s in shards if known_good is not None and str(s.token_path) in known_good)
    return DatasetInfo(
        num_samples=sum(s.n for s in shards), shards=shards, fully_checked=checked, known_good=good
    )


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


def _check_dtype(arr: np.ndarray, kind: npt.DTypeLike, path: Path, *, has: str, must: str, hint: str) -> None:
    """``arr`` holds numbers of ``kind`` (np.integer, np.floating), else a DataError: "``has``
    dtype D; ``must``"."""
    if not np.issubdtype(arr.dtype, kind):
        raise DataError(f"{has} dtype {arr.dtype}; {must}", where=str(path), hint=hint)


def _check_tokens_header(ids: np.ndarray, path: Path, m: ModelConfig) -> None:
    _check_dtype(
        ids,
        np.integer,
        path,
        has=f"{TOKENS_KEY} has",
        must="token ids must be integers",
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
    _check_dtype(
        lat,
        np.floating,
        path,
        has="latents have",
        must="latents must be floating point",
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


def _cannot_read_now(path: Path, e: OSError) -> FilesystemError:
    """A shard that cannot be read *now* (EIO, ESTALE, a flickering permission): not bad data."""
    return FilesystemError(
        f"cannot read this shard now ({e.strerror or e})",
        where=str(path),
        hint="check the filesystem; the attempt is retried like a crash",
    )


def open_latent_array(path: Path) -> np.ndarray:
    try:
        return retry_transient(lambda: np.load(path, mmap_mode="r", allow_pickle=False))
    except OSError as e:
        if e.errno in TRANSIENT_ERRNOS:
            raise _cannot_read_now(path, e) from None
        raise DataError(f"not a readable .npy array ({e})", where=str(path)) from None
    except (ValueError, EOFError) as e:
        raise DataError(f"not a readable .npy array ({e})", where=str(path)) from None


def open_token_array(path: Path) -> np.ndarray:
    """``input_ids`` of an .npz shard, memory-mapped when the member is stored uncompressed."""
    try:
        return retry_transient(lambda: _open_token_array(path))
    except OSError as e:
        if e.errno in TRANSIENT_ERRNOS:
            raise _cannot_read_now(path, e) from None
        raise DataError(f"not a readable .npz archive ({e})", where=str(path)) from None


def _open_token_array(path: Path) -> np.ndarray:
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
    except (zipfile.BadZipFile, ValueError, EOFError) as e:
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
