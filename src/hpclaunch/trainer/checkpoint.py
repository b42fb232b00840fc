"""Checkpoints of a training run: writing, publishing, validating, choosing, loading, pruning.

This module owns ``RUN/checkpoints/``. Data is written by torch.distributed.checkpoint (DCP), so DDP
today and FSDP later share one format; everything around DCP (atomic publishing, the manifest,
validation, safe unpickling, retention) lives here.

Layout and publishing
---------------------
``DIR/step_000123/`` (zero-padded to 6 digits, more when needed) holds DCP's ``__<rank>_<n>.distcp``
data files, DCP's ``.metadata`` and our ``manifest.json``. A save is written under
``DIR/.step_000123.tmp-<nonce>/``; once DCP has written ``.metadata`` (which it does only after
every rank's data files are fsynced) rank 0 writes ``manifest.json`` atomically (format version,
step, world size, config and model hashes, creation time, hpclaunch/torch versions, the caller's
``extra`` and the size and sha256 of every file) and publishes with ``os.rename`` + fsync of DIR.
A directory without a valid manifest does not exist for resume. Retention deletes by renaming to
``.step_000123.del-<nonce>`` first, so a half-deleted checkpoint never looks like a real one.

A published directory is never overwritten. Saving a step that is already published and has a
manifest for that step is skipped (it holds the same state: the typical case is the stop save right
after a periodic save of the same step). A published directory for that step without a usable
manifest (not ours, or damaged) is replaced: the new save is published by moving the old directory
aside and renaming the new one in, then the old one is deleted.

State-dict conventions (for the trainer)
----------------------------------------
``state`` is a nested dict of tensors and plain values (int, float, str, bool, None, and lists,
tuples and dicts of those). Non-tensor values are loaded with ``torch.load(weights_only=True)``,
so numpy objects are not allowed: keep RNG state as tensors or ints (``random.getstate()`` is a
tuple of ints and is fine; ``np.random.get_state()`` is not).

DCP saves a key once even when several ranks hold it (the "dedup trap"), so per-rank state must
live under a rank-unique key. The convention: everything rank-local goes under
``state[RANK_LOCAL][rank_local_key(rank)]`` (``state["rank_local"]["rank3"]``), and each rank puts
only its own entry there. Loading on a different world size tolerates missing and extra keys under
``RANK_LOCAL`` (ranks without a saved entry keep the values they came with, i.e. their fresh seeded
state; ``LoadResult.ranks_without_rank_local`` lists them); every other key must be in the
checkpoint, else loading fails with the missing keys named. Example::

    import random, torch
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def build_state(model, optimizer, sched, step, samples, rank):
        model_sd, optim_sd = get_state_dict(model, optimizer)  # DDP/FSDP aware, FQN keys
        return {
            "model": model_sd,
            "optim": optim_sd,
            "sched": sched.state_dict(),
            "progress": {"step": torch.tensor(step), "samples": torch.tensor(samples)},
            RANK_LOCAL: {rank_local_key(rank): {
                "torch_rng": torch.get_rng_state(),
                "python_rng": random.getstate(),
            }},
        }

    ckpt = Checkpointer(run.checkpoints, rank=rank, world_size=world, config_hash=ch,
                        model_hash=mh, keep_last=3, keep_every=1000, ledger=ledger)
    state = build_state(model, optimizer, sched, 0, 0, rank)
    result = ckpt.load_latest(state)            # fills `state` in place
    if result is not None:
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        sched.load_state_dict(state["sched"])
        step = int(state["progress"]["step"])
        if rank not in result.ranks_without_rank_local:
            mine = state[RANK_LOCAL][rank_local_key(rank)]
            torch.set_rng_state(mine["torch_rng"])
            random.setstate(mine["python_rng"])
    ...
    ckpt.save(step, build_state(model, optimizer, sched, step, samples, rank), blocking=False,
              extra={"samples_consumed": samples})

Safety
------
Nothing read from a checkpoint is unpickled with plain pickle: ``.metadata`` goes through an
allow-list unpickler (the classes DCP metadata actually contains) and non-tensor items through
``torch.load(weights_only=True)``. Anything else raises ``CheckpointError`` naming file and class.

Test hooks (environment variables, read at call time; never set them in production)
-----------------------------------------------------------------------------------
``HPCLAUNCH_TEST_CKPT_DELAY_WRITE_S=<seconds>``
    the writer sleeps this long before writing a save (proves that staging copied the state).
``HPCLAUNCH_TEST_CKPT_KILL=<step>:<rank>:<phase>``
    rank ``<rank>`` SIGKILLs itself while saving ``<step>``; phase ``data``: after its own data
    files are written, before ``.metadata``; phase ``publish``: after ``.metadata``, before
    ``manifest.json`` and the rename. Simulates ``kill -9`` in the middle of a checkpoint.

``scan_checkpoints`` and everything above the ``Checkpointer`` class are torch-free (``hpclaunch
status`` must not import torch); torch is imported inside the functions that need it.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import logging
import os
import pickle
import re
import shutil
import signal
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, NamedTuple

from ..errors import CheckpointError
from ..fsutil import atomic_write_json, fsync_dir
from ..orchestrator.runs import CHECKPOINT_INVALID, CHECKPOINT_SAVED, Ledger

if TYPE_CHECKING:
    from concurrent.futures import Future, ThreadPoolExecutor

    import torch.distributed as dist

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
METADATA_NAME = ".metadata"
RANK_LOCAL = "rank_local"
ENV_DELAY_WRITE = "HPCLAUNCH_TEST_CKPT_DELAY_WRITE_S"
ENV_KILL = "HPCLAUNCH_TEST_CKPT_KILL"

_STEP_RE = re.compile(r"^step_(\d{6,})$")
_LEFTOVER_RE = re.compile(r"^\.step_(\d{6,})\.(tmp|del)-[0-9a-f]+$")
# Files DCP writes; an unlisted one in a published directory means it was tampered with or mixed up.
_DCP_FILE_RE = re.compile(r"^(__\d+_\d+\.distcp|(__\d+)?\.metadata(\.tmp)?)$")
_HASH_CHUNK = 1 << 20


# --------------------------------------------------------------------------------------------
# Torch-free part: names, manifest, validation, scanning, retention.
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    path: Path
    manifest: dict[str, Any]  # the parsed manifest.json


@dataclass(frozen=True)
class LoadResult:
    info: CheckpointInfo
    skipped: list[tuple[Path, str]]  # newer checkpoints that were invalid, and why
    # Ranks of this run that found no saved RANK_LOCAL entry (world size changed): they keep the
    # state they came with.
    ranks_without_rank_local: list[int] = field(default_factory=list)


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
) -> dict[str, Any]:
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


def read_manifest(path: Path) -> dict[str, Any]:
    """The parsed manifest of checkpoint directory ``path``; raises InvalidCheckpoint."""
    try:
        text = (path / MANIFEST_NAME).read_text()
    except FileNotFoundError:
        raise InvalidCheckpoint("no manifest.json (the writer was killed before publishing)") from None
    except OSError as e:
        raise InvalidCheckpoint(f"cannot read manifest.json ({e.strerror})") from None
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
    return manifest


def verify_checkpoint(path: Path, *, verify_hashes: bool = True) -> CheckpointInfo:
    """Check a published directory against its manifest; raises InvalidCheckpoint with the reason."""
    match = _STEP_RE.match(path.name)
    if match is None or not path.is_dir():
        raise InvalidCheckpoint("not a step_NNNNNN directory")
    manifest = read_manifest(path)
    step = int(match.group(1))
    if manifest.get("step") != step:
        raise InvalidCheckpoint(f"manifest says step {manifest.get('step')!r}, directory says {step}")
    listed: dict[str, Any] = manifest["files"]
    _check_listing(path, listed)
    for name, entry in listed.items():
        _check_file(path / name, entry, verify_hashes=verify_hashes)
    return CheckpointInfo(step=step, path=path, manifest=manifest)


def _check_listing(path: Path, listed: dict[str, Any]) -> None:
    """Listed names are plain file names, .metadata is listed, no unlisted DCP file is present."""
    for name in listed:
        if not isinstance(name, str) or "/" in name or name in ("", ".", ".."):
            raise InvalidCheckpoint(f"manifest lists an invalid file name {name!r}")
    if METADATA_NAME not in listed:
        raise InvalidCheckpoint("manifest does not list .metadata (DCP did not finish)")
    for child in path.iterdir():
        if child.name not in listed and _DCP_FILE_RE.match(child.name):
            raise InvalidCheckpoint(f"unlisted file {child.name} (not part of this checkpoint)")


def _check_file(path: Path, entry: Any, *, verify_hashes: bool) -> None:
    if not isinstance(entry, dict) or not isinstance(entry.get("bytes"), int):
        raise InvalidCheckpoint(f"manifest entry for {path.name} is malformed")
    try:
        actual = path.stat().st_size
    except FileNotFoundError:
        raise InvalidCheckpoint(f"file {path.name} is missing") from None
    if actual != entry["bytes"]:
        hint = "truncated?" if actual < entry["bytes"] else "appended to?"
        raise InvalidCheckpoint(
            f"file {path.name} is {actual} bytes, manifest says {entry['bytes']} ({hint})"
        )
    if verify_hashes and file_digest(path)[1] != entry.get("sha256"):
        raise InvalidCheckpoint(f"sha256 mismatch in {path.name} (altered after it was written)")


def published_dirs(directory: Path) -> list[tuple[int, Path]]:
    """(step, path) of every ``step_N`` entry in ``directory``, oldest first (no validation)."""
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _STEP_RE.match(p.name))]
    return sorted(found)


def leftover_dirs(directory: Path) -> list[tuple[int, Path]]:
    """(step, path) of unpublished temporary / half-deleted directories, oldest first."""
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _LEFTOVER_RE.match(p.name))]
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
    directory: Path,
) -> tuple[CheckpointInfo | None, list[tuple[Path, str]]]:
    """The newest valid checkpoint and the invalid newer ones (verifies newest-first, stops early)."""
    skipped: list[tuple[Path, str]] = []
    for _, path in reversed(published_dirs(directory)):
        try:
            return verify_checkpoint(path), skipped
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


def _is_rank_local(flat_key: str) -> bool:
    return flat_key == RANK_LOCAL or flat_key.startswith(RANK_LOCAL + ".")


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


# --------------------------------------------------------------------------------------------
# Safe unpickling of DCP's .metadata: an allow-list of what a real Metadata pickle contains.
# (Found by recording find_class while unpickling the .metadata of a DDP model + AdamW state with
# every dtype and memory format we use.)
# --------------------------------------------------------------------------------------------

_METADATA_ALLOWED = frozenset(
    {
        ("torch.distributed.checkpoint.metadata", "Metadata"),
        ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "TensorProperties"),
        ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
        ("torch.distributed.checkpoint.metadata", "StorageMeta"),
        ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch.serialization", "_get_layout"),  # maps a layout name to torch.strided etc.
        ("torch", "Size"),
        # StorageMeta.checkpoint_id is the directory DCP wrote to.
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib._local", "PosixPath"),
        ("pathlib._local", "PurePosixPath"),
    }
)


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles only allow-listed DCP metadata classes and torch dtype/layout constants."""

    def __init__(self, file: IO[bytes], where: Path):
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        # Exact (module, name) match: dotted names like "PosixPath.touch" are refused too.
        if (module, name) in _METADATA_ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and _is_torch_constant(name):
            return super().find_class(module, name)
        raise CheckpointError(
            f"refusing to unpickle {module}.{name}: not a DCP metadata class "
            "(the file was altered or is not a DCP checkpoint)",
            where=str(self.where),
        )


def _is_torch_constant(name: str) -> bool:
    import torch

    value = getattr(torch, name, None)
    return isinstance(value, (torch.dtype, torch.layout, torch.memory_format))


def load_metadata_safely(path: Path) -> Any:
    """DCP's Metadata from a ``.metadata`` file, through the allow-list unpickler."""
    try:
        with open(path, "rb") as f:
            return _MetadataUnpickler(f, path).load()
    except CheckpointError:
        raise
    except FileNotFoundError:
        raise CheckpointError("no .metadata file", where=str(path)) from None
    except Exception as e:
        raise CheckpointError(
            f"cannot read DCP metadata ({type(e).__name__}: {e})", where=str(path)
        ) from None


_UNSUPPORTED_GLOBAL_RE = re.compile(r"Unsupported global: GLOBAL ([\w.]+)")


def load_item_safely(data: IO[bytes], where: str) -> Any:
    """One non-tensor DCP item, via ``torch.load(weights_only=True)`` (never plain pickle)."""
    import torch

    try:
        return torch.load(data, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        found = _UNSUPPORTED_GLOBAL_RE.search(str(e))
        what = found.group(1) if found else str(e).splitlines()[0]
        raise CheckpointError(
            f"refusing to unpickle {what}: only tensors and plain values are allowed "
            "(the file was altered, or the trainer saved an object that is not a plain value)",
            where=where,
        ) from None


# --------------------------------------------------------------------------------------------
# Torch part: DCP subclasses (built lazily so importing this module does not import torch),
# small JSON collectives, and the Checkpointer.
# --------------------------------------------------------------------------------------------


class _TorchParts(NamedTuple):
    reader: type[Any]
    planner: type[Any]
    hooked_writer: type[Any]


@functools.cache
def _torch_parts() -> _TorchParts:
    """The DCP reader/planner/writer subclasses; defined on first use so torch loads lazily."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.default_planner import create_default_local_load_plan
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
    from torch.distributed.checkpoint.planner import LoadPlan, ReadItem, SavePlan, SavePlanner
    from torch.distributed.checkpoint.storage import WriteResult
    from torch.futures import Future as TorchFuture

    class SafeReader(dcp.FileSystemReader):
        """FileSystemReader that hands DCP metadata we already read through the allow-list
        unpickler (read before dcp.load, so a refusal is not buried in DCP's fallbacks)."""

        def __init__(self, path: Path, metadata: Metadata) -> None:
            super().__init__(path)
            self.metadata = metadata

        def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
            storage_meta = self.metadata.storage_meta or StorageMeta()
            storage_meta.load_id = self.load_id
            self.metadata.storage_meta = storage_meta
            return self.metadata

        def file_of(self, read_item: ReadItem) -> str:
            return str(self.storage_data[read_item.storage_index].relative_path)

    class SafeLoadPlanner(dcp.DefaultLoadPlanner):
        """Loads non-tensor items with weights_only=True; tolerates missing RANK_LOCAL keys."""

        def __init__(self, reader: SafeReader, where: Path) -> None:
            super().__init__(allow_partial_load=False)
            self.reader = reader
            self.where = where
            self.saved_keys: list[str] = []

        def create_local_plan(self) -> LoadPlan:
            # Replaces DefaultLoadPlanner's version sniffing (for pre-2.4 checkpoints, which we
            # never write): it would re-add the rank-local keys we drop here.
            assert self.metadata is not None
            saved = self.metadata.state_dict_metadata
            self.saved_keys = list(saved)
            missing = [k for k in self.state_dict if k not in saved]
            required = [k for k in missing if not _is_rank_local(k)]
            if required:
                shown = ", ".join(sorted(required)[:5]) + (" ..." if len(required) > 5 else "")
                raise CheckpointError(
                    f"lacks {len(required)} key(s) this trainer needs: {shown} "
                    "(state layout changed; start a new run or restore the old code)",
                    where=str(self.where),
                )
            for key in missing:  # rank-local entries this checkpoint lacks: keep the caller's
                del self.state_dict[key]
            return create_default_local_load_plan(self.state_dict, self.metadata, True)

        def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
            fqn = read_item.dest_index.fqn
            where = f"{self.where / self.reader.file_of(read_item)} (item {fqn})"
            obj = load_item_safely(value, where)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[fqn], obj)
            else:
                self.state_dict[fqn] = obj

    class HookedWriter(dcp.FileSystemWriter):
        """Test-only writer: SIGKILLs this rank after its data files are written (ENV_KILL)."""

        def __init__(self, path: Path, on_data_written: Callable[[], None]) -> None:
            super().__init__(path, sync_files=True, overwrite=False)
            self.on_data_written = on_data_written

        def write_data(self, plan: SavePlan, planner: SavePlanner) -> TorchFuture[list[WriteResult]]:
            fut = super().write_data(plan, planner)
            fut.wait()
            self.on_data_written()
            return fut

    return _TorchParts(reader=SafeReader, planner=SafeLoadPlanner, hooked_writer=HookedWriter)


def _broadcast_json(obj: Any, pg: dist.ProcessGroup | None, *, is_source: bool) -> Any:
    """Rank 0's ``obj`` on every rank, as JSON bytes over ``pg`` (no pickle)."""
    if pg is None:
        return obj
    import torch
    import torch.distributed as dist

    data = json.dumps(obj).encode() if is_source else b""
    size = torch.tensor([len(data)], dtype=torch.int64)
    dist.broadcast(size, group=pg, group_src=0)
    buf = (
        torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if is_source
        else torch.empty(int(size.item()), dtype=torch.uint8)
    )
    dist.broadcast(buf, group=pg, group_src=0)
    return json.loads(bytes(buf.tolist()))


def _all_gather_json(obj: Any, pg: dist.ProcessGroup | None) -> list[Any]:
    """Every rank's ``obj`` (in group-rank order), as JSON bytes over ``pg`` (no pickle)."""
    if pg is None:
        return [obj]
    import torch
    import torch.distributed as dist

    data = json.dumps(obj).encode()
    n = dist.get_world_size(pg)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(n)]
    dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64), group=pg)
    width = max(int(s.item()) for s in sizes)
    mine = torch.zeros(width, dtype=torch.uint8)
    mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    bufs = [torch.empty(width, dtype=torch.uint8) for _ in range(n)]
    dist.all_gather(bufs, mine, group=pg)
    return [json.loads(bytes(b[: int(s.item())].tolist())) for b, s in zip(bufs, sizes, strict=True)]


def _as_checkpoint_error(exc: BaseException, what: str, where: Path) -> CheckpointError:
    """One CheckpointError from whatever DCP raised (it wraps per-rank errors)."""
    if isinstance(exc, CheckpointError):
        return exc
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = [(rank, pair[0]) for rank, pair in sorted(failures.items())]
        for _, err in inner:
            if isinstance(err, CheckpointError):
                return err
        err = inner[0][1]
        ranks = ",".join(str(r) for r, _ in inner)
        first = str(err).splitlines()[0] if str(err) else ""
        return CheckpointError(
            f"{what} failed on rank(s) {ranks}: {type(err).__name__}: {first}", where=str(where)
        )
    first = str(exc).splitlines()[0] if str(exc) else ""
    return CheckpointError(f"{what} failed: {type(exc).__name__}: {first}", where=str(where))


def _silence_single_process_warning() -> None:
    """DCP warns on every call that it is 'assuming single process'; that is what we want."""
    import warnings

    warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled, unavailable or uninitialized")


@dataclass(frozen=True)
class _SaveJob:
    """One save as every rank agreed on it (rank 0 chose the temporary directory's name)."""

    step: int
    tmp: Path
    final: Path
    replace: bool  # an unusable published directory of this step is to be replaced
    blocking: bool
    extra: dict[str, Any]
    started: float  # time.monotonic() when save() was called


class Checkpointer:
    """Saves and loads this run's checkpoints; construct it on all ranks at the same point."""

    def __init__(
        self,
        directory: Path,
        *,
        rank: int,
        world_size: int,
        config_hash: str,
        model_hash: str,
        keep_last: int,
        keep_every: int | None = None,
        async_save: bool = True,
        ledger: Ledger | None = None,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        if keep_last < 1:
            raise CheckpointError(f"keep_last must be >= 1, got {keep_last}")
        if keep_every is not None and keep_every < 1:
            raise CheckpointError(f"keep_every must be >= 1 or None, got {keep_every}")
        self.directory = Path(directory)
        self.rank = rank
        self.world_size = world_size
        self.config_hash = config_hash
        self.model_hash = model_hash
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.async_save = async_save
        self.ledger = ledger
        self.last_save_seconds: float | None = None
        self.last_stall_seconds: float | None = None
        self._pg, self._owns_pg = self._checkpoint_group(process_group)
        self._is_coordinator = rank == 0
        self._pending: Future[None] | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._stager: Any = None
        self._loading: set[int] = set()
        self._closed = False
        _torch_parts()  # import DCP now, so the first save does not pay for it in its stall
        if self._is_coordinator:
            self.directory.mkdir(parents=True, exist_ok=True)

    # ---- set-up -------------------------------------------------------------------------------

    def _checkpoint_group(self, given: dist.ProcessGroup | None) -> tuple[dist.ProcessGroup | None, bool]:
        """The gloo group for our collectives: background saves must never share a group (and
        so a collective order) with the training loop's collectives."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            if self.world_size != 1 or self.rank != 0:
                raise CheckpointError(
                    f"rank {self.rank} of {self.world_size} but torch.distributed is not "
                    "initialized; initialize it before creating the Checkpointer"
                )
            _silence_single_process_warning()
            return None, False
        if dist.get_rank() != self.rank or dist.get_world_size() != self.world_size:
            raise CheckpointError(
                f"Checkpointer was told rank {self.rank}/{self.world_size}, torch.distributed "
                f"says {dist.get_rank()}/{dist.get_world_size()}"
            )
        if given is not None:
            return given, False
        return dist.new_group(backend="gloo"), True

    def _stage(self, state: dict[str, Any]) -> dict[str, Any]:
        """A CPU copy of ``state`` that training may not touch (DCP's own stager; it copies CPU
        tensors too and reuses its CPU buffers from one save to the next)."""
        import torch
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        if self._stager is None:
            cuda = torch.cuda.is_available()
            # Staging happens in the caller's thread so it is complete when save() returns.
            options = StagingOptions(
                use_pinned_memory=cuda,
                use_shared_memory=False,
                use_async_staging=False,
                use_non_blocking_copy=cuda,
            )
            self._stager = DefaultStager(options)
        staged = self._stager.stage(state)
        assert isinstance(staged, dict)
        return staged

    def _submit(self, job: _SaveJob, staged: dict[str, Any]) -> None:
        from concurrent.futures import ThreadPoolExecutor

        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hpclaunch-ckpt")
        self._pending = self._executor.submit(self._write_and_publish, job, staged)

    # ---- save ---------------------------------------------------------------------------------

    def save(
        self,
        step: int,
        state: dict[str, Any],
        *,
        blocking: bool,
        extra: dict[str, Any] | None = None,
    ) -> None:
        """Save ``state`` as checkpoint ``step`` (collective: every rank calls it, same step)."""
        started = time.monotonic()
        if self._closed:
            raise CheckpointError("save() after close()")
        self.wait()
        job = self._plan_save(step, blocking=blocking or not self.async_save, extra=extra, started=started)
        if job is None:
            self.last_stall_seconds = time.monotonic() - started
            return
        if job.blocking:
            self._write_and_publish(job, state)
            self.last_stall_seconds = time.monotonic() - started
            return
        staged = self._stage(state)
        self.last_stall_seconds = time.monotonic() - started
        self._submit(job, staged)

    def _plan_save(
        self, step: int, *, blocking: bool, extra: dict[str, Any] | None, started: float
    ) -> _SaveJob | None:
        """Rank 0 decides (skip / write / replace), names the temporary directory and checks
        ``extra``; its errors are raised on every rank, so none is left waiting in a collective."""
        final = self.directory / step_dir_name(step)
        decision: dict[str, Any] = {}
        if self._is_coordinator:
            decision = self._decide(final, step, extra)
        decision = _broadcast_json(decision, self._pg, is_source=self._is_coordinator)
        if decision.get("error"):
            raise CheckpointError(decision["error"])
        if decision["action"] == "skip":
            if self._is_coordinator:
                log.info("checkpoint %s already published; not saving it again", final.name)
            return None
        tmp = self.directory / f".{final.name}.tmp-{decision['nonce']}"
        replace = decision["action"] == "replace"
        return _SaveJob(step, tmp, final, replace, blocking, decision["extra"], started)

    def _decide(self, final: Path, step: int, extra: dict[str, Any] | None) -> dict[str, Any]:
        try:
            return {
                "action": self._existing_action(final, step),
                "nonce": uuid.uuid4().hex[:12],
                "extra": _jsonable(extra),
            }
        except CheckpointError as e:
            return {"error": e.one_line()}
        except OSError as e:
            return {"error": f"cannot prepare checkpoint {final}: {e}"}

    def _existing_action(self, final: Path, step: int) -> str:
        if not final.exists():
            return "write"
        try:
            if read_manifest(final).get("step") == step:
                return "skip"
        except InvalidCheckpoint:
            pass
        log.warning("checkpoint %s exists without a usable manifest; it will be replaced", final.name)
        return "replace"

    def _write_and_publish(self, job: _SaveJob, state: dict[str, Any]) -> None:
        """Every rank: DCP write, hash own files; rank 0: manifest + publish. Collective."""
        begun = time.monotonic()
        _test_delay_write()
        self._dcp_save(job, state)
        _test_kill(job.step, self.rank, "publish")
        reports = _all_gather_json(self._own_digests(job.tmp), self._pg)
        status: dict[str, Any] = {}
        if self._is_coordinator:
            status = self._publish_or_report(job, reports, begun)
        status = _broadcast_json(status, self._pg, is_source=self._is_coordinator)
        if status.get("error"):
            raise CheckpointError(f"publishing failed: {status['error']}", where=str(job.final))
        self.last_save_seconds = time.monotonic() - begun

    def _dcp_save(self, job: _SaveJob, state: dict[str, Any]) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        try:
            dcp.save(
                state, storage_writer=self._writer(job), process_group=self._pg, no_dist=self._pg is None
            )
        except (Exception, CheckpointException) as e:  # DCP's is a BaseException
            raise _as_checkpoint_error(e, f"writing {job.final.name}", job.tmp) from e

    def _writer(self, job: _SaveJob) -> Any:
        import torch.distributed.checkpoint as dcp

        if _kill_requested(job.step, self.rank, "data"):
            return _torch_parts().hooked_writer(job.tmp, lambda: _test_kill(job.step, self.rank, "data"))
        return dcp.FileSystemWriter(job.tmp, sync_files=True, overwrite=False)

    def _own_digests(self, tmp: Path) -> dict[str, Any]:
        """Sizes and sha256 of the data files this rank wrote (ranks hash in parallel)."""
        import torch.distributed as dist

        group_rank = dist.get_rank(self._pg) if self._pg is not None else 0
        try:
            mine = sorted(tmp.glob(f"__{group_rank}_*.distcp"))
            return {"files": {p.name: list(file_digest(p)) for p in mine}}
        except OSError as e:
            return {"error": f"rank {self.rank} cannot hash its files: {e}"}

    def _publish_or_report(self, job: _SaveJob, reports: list[Any], begun: float) -> dict[str, Any]:
        try:
            self._publish(job, reports, begun)
            return {}
        except Exception as e:  # reported to every rank, raised there on the next save/wait
            log.error("publishing %s failed: %s", job.final.name, e)
            return {"error": str(e)}

    def _publish(self, job: _SaveJob, reports: list[Any], begun: float) -> None:
        errors = [r["error"] for r in reports if r.get("error")]
        if errors:
            raise CheckpointError("; ".join(errors), where=str(job.tmp))
        if not (job.tmp / METADATA_NAME).is_file():
            raise CheckpointError("DCP finished without writing .metadata", where=str(job.tmp))
        files = _collect_digests(job.tmp, reports)
        manifest = build_manifest(
            step=job.step,
            world_size=self.world_size,
            config_hash=self.config_hash,
            model_hash=self.model_hash,
            extra=job.extra,
            files=files,
            torch_version=_torch_version(),
        )
        atomic_write_json(job.tmp / MANIFEST_NAME, manifest)
        self._rename_into_place(job)
        self._apply_retention(protect={job.step})
        self._report_saved(job, manifest, time.monotonic() - begun)

    def _rename_into_place(self, job: _SaveJob) -> None:
        aside = None
        if job.replace and job.final.exists():
            aside = self.directory / f".{job.final.name}.del-{uuid.uuid4().hex[:12]}"
            os.rename(job.final, aside)
        # rename() of a directory onto an existing non-empty one fails: never overwrites.
        os.rename(job.tmp, job.final)
        fsync_dir(self.directory)
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)

    def _report_saved(self, job: _SaveJob, manifest: dict[str, Any], seconds: float) -> None:
        stall = self.last_stall_seconds if not job.blocking else time.monotonic() - job.started
        size = int(manifest["total_bytes"])
        log.info(
            "saved checkpoint %s (%.1f MB, %.2f s, %s, training stalled %.3f s)",
            job.final.name,
            size / 1e6,
            seconds,
            "blocking" if job.blocking else "async",
            stall or 0.0,
        )
        if self.ledger is not None:
            self.ledger.append(
                CHECKPOINT_SAVED,
                step=job.step,
                path=str(job.final),
                seconds=round(seconds, 3),
                bytes=size,
                blocking=job.blocking,
                stall_s=round(stall, 4) if stall is not None else None,
            )

    # ---- retention ----------------------------------------------------------------------------

    def _apply_retention(self, *, protect: set[int]) -> None:
        steps = [s for s, _ in published_dirs(self.directory)]
        doomed = steps_to_delete(
            steps,
            keep_last=self.keep_last,
            keep_every=self.keep_every,
            protect=protect | self._loading,
        )
        for step in doomed:
            self._delete(self.directory / step_dir_name(step))

    def _delete(self, path: Path) -> None:
        """Rename first so that a kill mid-delete leaves a leftover, never a broken step_N."""
        aside = self.directory / f".{path.name}.del-{uuid.uuid4().hex[:12]}"
        try:
            os.rename(path, aside)
        except FileNotFoundError:
            return
        fsync_dir(self.directory)
        shutil.rmtree(aside, ignore_errors=True)
        log.info("retention: deleted checkpoint %s", path.name)

    # ---- wait / close -------------------------------------------------------------------------

    def wait(self) -> None:
        """Finish (publish) a pending background save; re-raise its error."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        """Wait for a pending save, then release the thread, staging buffers and our group."""
        if self._closed:
            return
        self._closed = True
        try:
            self.wait()
        finally:
            self._teardown()

    def _teardown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        if self._stager is not None:
            self._stager.close()
        if self._owns_pg and self._pg is not None:
            import torch.distributed as dist

            dist.destroy_process_group(self._pg)
        self._pg = None

    # ---- load ---------------------------------------------------------------------------------

    def list_valid(self) -> list[CheckpointInfo]:
        """Valid checkpoints in DIR, newest last (reads and hashes files; call on one rank)."""
        return scan_checkpoints(self.directory)[0]

    def load_latest(self, state: dict[str, Any]) -> LoadResult | None:
        """Load the newest valid checkpoint into ``state`` in place; None when there is none.

        Collective. Rank 0 removes leftovers of killed writers, verifies newest-first and tells
        every rank which one to load; invalid newer ones are reported and skipped.
        """
        self.wait()
        choice: dict[str, Any] = {}
        if self._is_coordinator:
            choice = self._choose()
        choice = _broadcast_json(choice, self._pg, is_source=self._is_coordinator)
        if choice.get("error"):
            raise CheckpointError(choice["error"])
        if choice.get("step") is None:
            return None
        info = CheckpointInfo(
            step=int(choice["step"]),
            path=self.directory / choice["name"],
            manifest=choice["manifest"],
        )
        skipped = [(Path(p), reason) for p, reason in choice["skipped"]]
        self._loading.add(info.step)
        try:
            missing_ranks = self._dcp_load(info, state)
        finally:
            self._loading.discard(info.step)
        return LoadResult(info=info, skipped=skipped, ranks_without_rank_local=missing_ranks)

    def _choose(self) -> dict[str, Any]:
        """Rank 0: the checkpoint to load, as JSON for the broadcast (errors included)."""
        try:
            leftovers = self._remove_leftovers()
            info, skipped = newest_valid(self.directory)
            for path, reason in skipped + [(p, r) for _, p, r in leftovers]:
                self._report_invalid(path, reason)
            chosen = info.step if info else -1
            skipped += [(p, reason) for step, p, reason in leftovers if step > chosen]
            if info is None:
                log.info("no valid checkpoint in %s; starting fresh", self.directory)
                return {"step": None}
            self._check_compatible(info)
            log.info("resuming from checkpoint %s", info.path.name)
            return {
                "step": info.step,
                "name": info.path.name,
                "manifest": info.manifest,
                "skipped": [[str(p), r] for p, r in skipped],
            }
        except CheckpointError as e:
            return {"error": e.one_line()}
        except Exception as e:
            return {"error": f"choosing a checkpoint in {self.directory} failed: {type(e).__name__}: {e}"}

    def _remove_leftovers(self) -> list[tuple[int, Path, str]]:
        """Delete unpublished / half-deleted directories of killed writers; return what they were."""
        removed = []
        for step, path in leftover_dirs(self.directory):
            reason = f"{leftover_reason(path)}; removed"
            if ".del-" in path.name:
                log.info("removing %s (%s)", path.name, reason)
            else:
                removed.append((step, path, reason))
            shutil.rmtree(path, ignore_errors=True)
        if removed:
            fsync_dir(self.directory)
        return removed

    def _report_invalid(self, path: Path, reason: str) -> None:
        log.warning("skipping checkpoint %s: %s", path.name, reason)
        if self.ledger is not None:
            self.ledger.append(CHECKPOINT_INVALID, path=str(path), reason=reason)

    def _check_compatible(self, info: CheckpointInfo) -> None:
        theirs = info.manifest.get("model_hash")
        if theirs != self.model_hash:
            raise CheckpointError(
                f"checkpoint {info.path.name} was written for a different model shape "
                f"(model_hash {theirs} != {self.model_hash}: model.depth/dim_* or another shape "
                "setting changed); start a new run or restore the old model config"
            )
        if info.manifest.get("config_hash") != self.config_hash:
            log.info(
                "checkpoint %s was written with a different config (non-shape settings changed)",
                info.path.name,
            )
        saved_world = info.manifest.get("world_size")
        if saved_world != self.world_size:
            log.info(
                "checkpoint %s was written by %s ranks, this run has %s",
                info.path.name,
                saved_world,
                self.world_size,
            )

    def _dcp_load(self, info: CheckpointInfo, state: dict[str, Any]) -> list[int]:
        """DCP load through the safe reader/planner; returns ranks that got no RANK_LOCAL entry."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        parts = _torch_parts()
        reader = parts.reader(info.path, self._read_metadata_everywhere(info.path))
        planner = parts.planner(reader, info.path)
        try:
            dcp.load(
                state,
                storage_reader=reader,
                planner=planner,
                process_group=self._pg,
                no_dist=self._pg is None,
            )
        except (Exception, CheckpointException) as e:  # DCP's is a BaseException
            raise _as_checkpoint_error(e, f"loading {info.path.name}", info.path) from e
        saved_ranks = _ranks_with_rank_local(planner.saved_keys)
        missing = sorted(set(range(self.world_size)) - saved_ranks)
        if self._is_coordinator:
            self._report_rank_local(info, saved_ranks, missing)
        return missing

    def _read_metadata_everywhere(self, path: Path) -> Any:
        """Every rank reads .metadata safely; if any rank cannot, all raise (no rank is left
        waiting in a DCP collective)."""
        from torch.distributed.checkpoint.metadata import Metadata

        metadata, error = None, None
        try:
            metadata = load_metadata_safely(path / METADATA_NAME)
            if not isinstance(metadata, Metadata):
                raise CheckpointError("is not DCP metadata", where=str(path / METADATA_NAME))
        except CheckpointError as e:
            error = e
        errors = [msg for msg in _all_gather_json(error and error.one_line(), self._pg) if msg]
        if error is not None:
            raise error
        if errors:
            raise CheckpointError(f"another rank cannot read the checkpoint: {errors[0]}")
        return metadata

    def _report_rank_local(self, info: CheckpointInfo, saved: set[int], missing: list[int]) -> None:
        if missing and saved:
            log.warning(
                "checkpoint %s has no %s state for rank(s) %s; they keep their freshly seeded state",
                info.path.name,
                RANK_LOCAL,
                ",".join(map(str, missing)),
            )
        unused = sorted(r for r in saved if r >= self.world_size)
        if unused:
            log.info(
                "checkpoint %s: saved %s state of rank(s) %s is not used by %d ranks",
                info.path.name,
                RANK_LOCAL,
                ",".join(map(str, unused)),
                self.world_size,
            )


def _collect_digests(tmp: Path, reports: list[Any]) -> dict[str, tuple[int, str]]:
    """Every file in ``tmp``: the digest its writer reported, or rank 0 hashes it itself."""
    reported: dict[str, tuple[int, str]] = {}
    for report in reports:
        for name, (size, sha) in report.get("files", {}).items():
            reported[name] = (int(size), str(sha))
    files: dict[str, tuple[int, str]] = {}
    for path in sorted(tmp.iterdir()):
        if path.name == MANIFEST_NAME or not path.is_file():
            continue
        known = reported.get(path.name)
        files[path.name] = known if known and known[0] == path.stat().st_size else file_digest(path)
    return files


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


def _test_delay_write() -> None:
    seconds = os.environ.get(ENV_DELAY_WRITE)
    if seconds:
        time.sleep(float(seconds))


def _kill_requested(step: int, rank: int, phase: str) -> bool:
    return os.environ.get(ENV_KILL, "") == f"{step}:{rank}:{phase}"


def _test_kill(step: int, rank: int, phase: str) -> None:
    if _kill_requested(step, rank, phase):
        log.warning("test hook %s: rank %d kills itself (%s phase of step %d)", ENV_KILL, rank, phase, step)
        logging.shutdown()
        os.kill(os.getpid(), signal.SIGKILL)
