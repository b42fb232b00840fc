"""Checkpoint directories without torch: names, the manifest, verification, scanning, retention.

``hpclaunch status`` and preflight read checkpoints through this module, so it never imports torch.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TypedDict, cast

from ..errors import CheckpointError, FilesystemError
from ..fsutil import retry_transient
from .paths import STEP_DIR_RE

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
METADATA_NAME = ".metadata"
RANK_LOCAL = "rank_local"
# Top-level sections a checkpoint may lack (the loader keeps the caller's values for them):
# rank-local state (another world size) and the EMA (turned on after the checkpoint was written).
OPTIONAL_SECTIONS = (RANK_LOCAL, "ema")
CORRUPT_SUFFIX = ".corrupt"

_STEP_RE = STEP_DIR_RE
_LEFTOVER_RE = re.compile(r"^\.step_(\d{6,})\.(tmp|del)-[0-9a-f]+$")
# Files DCP writes; an unlisted one in a published directory means it was tampered with or mixed up.
_DCP_FILE_RE = re.compile(r"^(__\d+_\d+\.distcp|(__\d+)?\.metadata(\.tmp)?)$")
_HASH_CHUNK = 1 << 20


class FileEntry(TypedDict):
    bytes: int
    sha256: str


class Manifest(TypedDict):
    """manifest.json, as ``build_manifest`` writes it. ``read_manifest`` checks the format version
    and the ``files`` table only (each entry is checked against its file): readers ``.get`` the rest."""

    format_version: int
    step: int
    world_size: int
    config_hash: str
    model_hash: str
    created: str  # ISO 8601, UTC, seconds
    created_unix: float
    hpclaunch_version: str
    torch_version: str | None
    extra: dict[str, Any]  # the caller's (``save(extra=...)``): the run's own fields
    total_bytes: int
    files: dict[str, FileEntry]


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    path: Path
    manifest: Manifest  # the parsed manifest.json


@dataclass(frozen=True)
class LoadResult:
    info: CheckpointInfo
    skipped: list[tuple[Path, str]]  # newer checkpoints that were invalid, and why
    # Ranks of this run that found no saved RANK_LOCAL entry (world size changed): they keep the
    # state they came with.
    ranks_without_rank_local: list[int] = field(default_factory=list)
    # Top-level keys the checkpoint holds (e.g. "ema" is absent when it was written without one).
    saved_sections: set[str] = field(default_factory=set)


class InvalidCheckpoint(Exception):
    """A directory is not a usable checkpoint; ``str()`` is the reason (one line)."""


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def rank_local_key(rank: int) -> str:
    """The key of ``rank``'s entry under ``state[RANK_LOCAL]``."""
    return f"rank{rank}"


def file_digest(path: Path) -> tuple[int, str]:
    """(size in bytes, sha256 hex) of one file."""
    h = hashlib.sha256()
    size = 0
    buf = bytearray(_HASH_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
            size += n
    return size, h.hexdigest()


def build_manifest(
    *,
    step: int,
    world_size: int,
    config_hash: str,
    model_hash: str,
    extra: dict[str, Any],
    files: dict[str, tuple[int, str]],
    torch_version: str | None = None,
) -> Manifest:
    """The manifest.json content for one checkpoint (``files``: name -> (bytes, sha256))."""
    from .. import __version__

    return {
        "format_version": FORMAT_VERSION,
        "step": step,
        "world_size": world_size,
        "config_hash": config_hash,
        "model_hash": model_hash,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "created_unix": round(time.time(), 3),
        "hpclaunch_version": __version__,
        "torch_version": torch_version,
        "extra": extra,
        "total_bytes": sum(size for size, _ in files.values()),
        "files": {name: {"bytes": size, "sha256": sha} for name, (size, sha) in sorted(files.items())},
    }


def unreadable(path: Path, e: OSError) -> FilesystemError:
    """A file that cannot be read *now* (EIO, ESTALE, EACCES...): never a verdict on the checkpoint."""
    return FilesystemError(
        f"cannot read {path.name} now ({e.strerror or e}); the checkpoint is left as it is",
        where=str(path),
        hint="check the filesystem; the attempt is retried like a crash",
    )


def read_manifest(path: Path) -> Manifest:
    """The parsed manifest of checkpoint directory ``path``; raises InvalidCheckpoint when the
    manifest is missing or bad, FilesystemError when it cannot be read now (after retries)."""
    try:
        text = retry_transient((path / MANIFEST_NAME).read_text)
    except FileNotFoundError:
        raise InvalidCheckpoint("no manifest.json (the writer was killed before publishing)") from None
    except OSError as e:
        raise unreadable(path / MANIFEST_NAME, e) from None
    try:
        manifest = json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidCheckpoint(f"manifest.json is not valid JSON ({e.msg}, line {e.lineno})") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise InvalidCheckpoint("manifest.json has no 'files' table")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise InvalidCheckpoint(
            f"manifest format {manifest.get('format_version')!r} is not {FORMAT_VERSION} "
            "(written by another hpclaunch version)"
        )
    return cast(Manifest, manifest)  # as far as checked: its readers .get() the other fields


def verify_checkpoint(path: Path, *, verify_hashes: bool = True) -> CheckpointInfo:
    """Check a published directory against its manifest; raises InvalidCheckpoint with the reason."""
    match = _STEP_RE.fullmatch(path.name)
    if match is None or not path.is_dir():
        raise InvalidCheckpoint("not a step_NNNNNN directory")
    manifest = read_manifest(path)
    step = int(match.group(1))
    if manifest.get("step") != step:
        raise InvalidCheckpoint(f"manifest says step {manifest.get('step')!r}, directory says {step}")
    listed = manifest["files"]
    _check_listing(path, listed)
    for name, entry in listed.items():
        _check_file(path / name, entry, verify_hashes=verify_hashes)
    return CheckpointInfo(step=step, path=path, manifest=manifest)


def _check_listing(path: Path, listed: dict[str, FileEntry]) -> None:
    """Listed names are plain file names, .metadata is listed, no unlisted DCP file is present."""
    for name in listed:
        if not isinstance(name, str) or "/" in name or name in ("", ".", ".."):
            raise InvalidCheckpoint(f"manifest lists an invalid file name {name!r}")
    if METADATA_NAME not in listed:
        raise InvalidCheckpoint("manifest does not list .metadata (DCP did not finish)")
    for child in path.iterdir():
        if child.name not in listed and _DCP_FILE_RE.fullmatch(child.name):
            raise InvalidCheckpoint(f"unlisted file {child.name} (not part of this checkpoint)")


def _check_file(path: Path, entry: Any, *, verify_hashes: bool) -> None:
    if not isinstance(entry, dict) or not isinstance(entry.get("bytes"), int):
        raise InvalidCheckpoint(f"manifest entry for {path.name} is malformed")
    try:
        actual = retry_transient(path.stat).st_size
    except FileNotFoundError:
        raise InvalidCheckpoint(f"file {path.name} is missing") from None
    except OSError as e:
        raise unreadable(path, e) from None
    if actual != entry["bytes"]:
        hint = "truncated?" if actual < entry["bytes"] else "appended to?"
        raise InvalidCheckpoint(
            f"file {path.name} is {actual} bytes, manifest says {entry['bytes']} ({hint})"
        )
    if verify_hashes:
        try:
            digest = retry_transient(lambda: file_digest(path))[1]
        except FileNotFoundError:
            raise InvalidCheckpoint(f"file {path.name} is missing") from None
        except OSError as e:
            raise unreadable(path, e) from None
        if digest != entry.get("sha256"):
            raise InvalidCheckpoint(f"sha256 mismatch in {path.name} (altered after it was written)")


def verify_share(info: CheckpointInfo, rank: int, world: int) -> None:
    """Hash this rank's share of ``info``'s files against the manifest (every ``world``-th file,
    from ``rank``): at resume every rank checks a part, as every rank hashed what it wrote at save,
    so a large checkpoint is verified in the time of its share, not of the whole on one rank.
    Raises InvalidCheckpoint or FilesystemError."""
    listed = info.manifest["files"]
    for name in sorted(listed)[rank::world]:
        _check_file(info.path / name, listed[name], verify_hashes=True)


def published_dirs(directory: Path) -> list[tuple[int, Path]]:
    """(step, path) of every ``step_N`` entry in ``directory``, oldest first (no validation)."""
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _STEP_RE.fullmatch(p.name))]
    return sorted(found)


def leftover_dirs(directory: Path) -> list[tuple[int, Path]]:
    """(step, path) of unpublished temporary / half-deleted directories, oldest first."""
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _LEFTOVER_RE.fullmatch(p.name))]
    return sorted(found)


def leftover_reason(path: Path) -> str:
    if ".del-" in path.name:
        return "half-deleted by retention (the process was killed while deleting it)"
    return "never published (a save still in progress, or the writer was killed before publishing)"


def scan_checkpoints(
    directory: Path, *, verify_hashes: bool = True
) -> tuple[list[CheckpointInfo], list[tuple[Path, str]]]:
    """Valid checkpoints (oldest first) and invalid ones with reasons (torch-free, read-only).

    ``verify_hashes=False`` checks presence and sizes only (fast, for ``status`` on big runs).
    """
    directory = Path(directory)
    valid: list[CheckpointInfo] = []
    invalid: list[tuple[Path, str]] = []
    for _, path in published_dirs(directory):
        try:
            valid.append(verify_checkpoint(path, verify_hashes=verify_hashes))
        except InvalidCheckpoint as e:
            invalid.append((path, str(e)))
    invalid.extend((path, leftover_reason(path)) for _, path in leftover_dirs(directory))
    return valid, invalid


def newest_valid(
    directory: Path, *, verify_hashes: bool = True
) -> tuple[CheckpointInfo | None, list[tuple[Path, str]]]:
    """The newest valid checkpoint and the invalid newer ones (verifies newest-first, stops early).
    A checkpoint that cannot be read now raises FilesystemError: it is not skipped as invalid."""
    skipped: list[tuple[Path, str]] = []
    for _, path in reversed(published_dirs(directory)):
        try:
            return verify_checkpoint(path, verify_hashes=verify_hashes), skipped
        except InvalidCheckpoint as e:
            skipped.append((path, str(e)))
    return None, skipped


def steps_to_delete(
    steps: Iterable[int], *, keep_last: int, keep_every: int | None, protect: Iterable[int]
) -> list[int]:
    """Steps retention removes: all but the ``keep_last`` newest, multiples of ``keep_every``
    and ``protect``."""
    ordered = sorted(set(steps))
    keep = set(ordered[-keep_last:]) if keep_last > 0 else set()
    keep.update(protect)
    if keep_every:
        keep.update(s for s in ordered if s % keep_every == 0)
    return [s for s in ordered if s not in keep]


def _is_optional(flat_key: str) -> bool:
    return any(flat_key == s or flat_key.startswith(s + ".") for s in OPTIONAL_SECTIONS)


def move_aside_corrupt(path: Path) -> Path:
    """Rename an invalid published checkpoint to ``step_N.corrupt`` (``.corrupt-2``, ...), so the
    step no longer exists for resume or retention and is saved again when the run recomputes it.
    The files stay for inspection; nothing ever loads or prunes a ``.corrupt`` directory."""
    target = path.with_name(path.name + CORRUPT_SUFFIX)
    n = 2
    while target.exists():
        target = path.with_name(f"{path.name}{CORRUPT_SUFFIX}-{n}")
        n += 1
    path.rename(target)
    return target


def file_signature(path: Path) -> tuple[tuple[str, int, int], ...]:
    """(name, size, mtime_ns) of every file in a checkpoint directory: unchanged since verified?"""
    out = []
    for child in sorted(path.iterdir()):
        st = child.stat()
        out.append((child.name, int(st.st_size), int(st.st_mtime_ns)))
    return tuple(out)


def _ranks_with_rank_local(flat_keys: Iterable[str]) -> set[int]:
    """Ranks that have an entry ``RANK_LOCAL.rank<r>`` among the checkpoint's flat keys."""
    pattern = re.compile(rf"^{RANK_LOCAL}\.rank(\d+)(\.|$)")
    return {int(m.group(1)) for k in flat_keys if (m := pattern.match(k))}


def _jsonable(extra: dict[str, Any] | None) -> dict[str, Any]:
    """``extra`` as it will be stored; refuses what JSON cannot hold, in the caller's thread."""
    try:
        return dict(json.loads(json.dumps(extra or {})))
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"extra manifest fields are not JSON-serializable: {e}") from None
