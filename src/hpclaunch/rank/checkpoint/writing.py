"""One save's write and publish: DCP's files, their sha256, the manifest, the rename, retention.

This is the part of a save that runs wherever the writer runs: in the training process for a
blocking save (and for the thread writer, in its thread), in the writer process for the process
writer (``writer_main``). Every rank writes its own data files and hashes them; the coordinator
(rank 0 of the writers' group) writes the manifest, publishes by rename + directory fsync and
applies retention, and tells every rank how it went, so a failure is raised on every rank alike.
What a publish produced comes back as ``Published``; the caller reports it (log, ledger).
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import time
import warnings
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

from ...errors import CheckpointError
from ...fsutil import atomic_write_json, fsync_dir
from ...rundir.checkpoint_manifest import (
    MANIFEST_NAME,
    METADATA_NAME,
    build_manifest,
    file_digest,
    move_aside_corrupt,
)
from ..dist import all_gather_json, broadcast_json
from .directory import CheckpointDir
from .fault_hooks import delay_write_hook, hooked_writer_class, injected_failure, kill_hook, kill_requested
from .save_errors import is_filesystem_failure, save_error
from .save_plans import SavePlans

if TYPE_CHECKING:
    import torch.distributed as dist

log = logging.getLogger("hpclaunch.rank.checkpoint")


@dataclass(frozen=True)
class SaveJob:
    """One save as every rank agreed on it (rank 0 chose the temporary directory's name)."""

    step: int
    tmp: Path
    final: Path
    blocking: bool
    extra: dict[str, Any]
    started: float  # time.monotonic() in the training process when save() was called
    needed_bytes: int  # about what the whole checkpoint takes on disk (for a "no space" message)

    def to_json(self) -> dict[str, object]:
        return {**asdict(self), "tmp": str(self.tmp), "final": str(self.final)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> SaveJob:
        return cls(**{**data, "tmp": Path(data["tmp"]), "final": Path(data["final"])})


@dataclass(frozen=True)
class Published:
    """What the coordinator published (the other ranks get None)."""

    step: int
    path: str
    bytes: int
    seconds: float  # from the start of the write to the end of retention


class DigestReport(TypedDict, total=False):
    """One rank's account of the data files it wrote, gathered on the coordinator as JSON."""

    files: dict[str, tuple[int, str]]  # name -> (bytes, sha256)
    error: str  # it could not hash them


class PublishStatus(TypedDict, total=False):
    """The coordinator's word on the publish, broadcast as JSON (no key: published)."""

    error: str
    hint: str | None


def quiet_dcp_logger() -> None:
    """DCP logs every call of its methods at DEBUG to a logger with only a NullHandler: records
    built for nobody, ~15 ms of CPU per save of a few hundred tensors (cProfile). Raise its level."""
    from torch.distributed.checkpoint import logger as dcp_logger

    quiet = getattr(dcp_logger, "_dcp_logger", None)
    if isinstance(quiet, logging.Logger) and all(isinstance(h, logging.NullHandler) for h in quiet.handlers):
        quiet.setLevel(logging.WARNING)


MAX_AUTO_WRITE_THREADS = 8


def resolve_write_threads(setting: int | str, ranks_on_node: int, cores: int | None = None) -> int:
    """``checkpoint.write_threads`` as a number: ``auto`` gives each rank its share of the node's
    cores (at least 1, at most ``MAX_AUTO_WRITE_THREADS``); a number is kept."""
    if setting != "auto":
        return max(1, int(setting))
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(MAX_AUTO_WRITE_THREADS, cores // max(1, ranks_on_node)))


class SaveWriter:
    """Writes and publishes saves of one checkpoint directory from one rank (collective over ``pg``)."""

    def __init__(
        self,
        checkpoints: CheckpointDir,
        *,
        rank: int,
        plans: SavePlans,
        pg: dist.ProcessGroup | None,
        in_writer_process: bool = False,
        before_write: Callable[[], None] | None = None,
        write_threads: int = 1,
    ) -> None:
        self.run = checkpoints.run  # the directory, world and hashes every save is written for
        self.directory = self.run.directory
        self.write_threads = max(1, write_threads)
        self.rank = rank
        self.checkpoints = checkpoints
        self.plans = plans
        self.pg = pg
        self.in_writer_process = in_writer_process
        self.before_write = before_write
        self.loading: set[int] = set()
        quiet_dcp_logger()

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    def write_and_publish(
        self, job: SaveJob, state: dict[str, Any], **planner_attrs: Any
    ) -> Published | None:
        """Every rank: DCP write, hash own files; rank 0: manifest + publish. Collective."""
        begun = time.monotonic()
        if self.before_write is not None:
            self.before_write()
        delay_write_hook(in_writer_process=self.in_writer_process)
        self._dcp_save(job, state, planner_attrs)
        kill_hook(job.step, self.rank, "publish", in_writer_process=self.in_writer_process)
        reports = all_gather_json(self._own_digests(job.tmp), self.pg)
        status: PublishStatus = {}
        published: Published | None = None
        if self.is_coordinator:
            published, status = self._publish_or_report(job, reports, begun)
        status = broadcast_json(status, self.pg, is_source=self.is_coordinator)
        if status.get("error"):
            raise CheckpointError(
                f"publishing failed: {status['error']}", where=str(job.final), hint=status.get("hint")
            )
        return published

    def _dcp_save(self, job: SaveJob, state: dict[str, Any], planner_attrs: dict[str, Any]) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        if self.pg is None:
            # One rank saves without a group (no_dist): DCP warns, on every save, that it assumes
            # exactly that. A process-wide filter (the writer process has its own): catch_warnings
            # would swap the filters under the training thread's feet.
            warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled, unavailable")
        try:
            dcp.save(
                state,
                storage_writer=self._storage_writer(job),
                planner=self.plans.planner(**planner_attrs),
                process_group=self.pg,
                no_dist=self.pg is None,
            )
        except (Exception, CheckpointException) as e:  # DCP's is a BaseException
            self.plans.forget()  # the ranks' cached plans may be out of step now
            fs = is_filesystem_failure(e, directory=self.directory, needed_bytes=job.needed_bytes)
            if self.is_coordinator and fs:  # free the space a half-written save holds, then measure
                shutil.rmtree(job.tmp, ignore_errors=True)  # (a peer's death leaves it for the resume)
            raise save_error(e, directory=self.directory, step=job.step, needed_bytes=job.needed_bytes) from e

    def _storage_writer(self, job: SaveJob) -> Any:
        # (Hashing as DCP writes would save reading the files back, but torch.save writes a record
        # in dozens of small pieces: a Python hook on each cost more CPU than the second pass.)
        fail = injected_failure(job.step, self.rank)
        if fail is not None or kill_requested(job.step, self.rank, "data"):
            return hooked_writer_class()(
                job.tmp,
                fail,
                lambda: kill_hook(job.step, self.rank, "data", in_writer_process=self.in_writer_process),
            )
        return direct_writer_class()(
            job.tmp, sync_files=True, overwrite=False, thread_count=self.write_threads
        )

    def _own_digests(self, tmp: Path) -> DigestReport:
        """Sizes and sha256 of the data files this rank wrote (ranks hash in parallel)."""
        import torch.distributed as dist

        group_rank = dist.get_rank(self.pg) if self.pg is not None else 0
        try:
            mine = sorted(tmp.glob(f"__{group_rank}_*.distcp"))
            if len(mine) < 2 or self.write_threads < 2:
                return {"files": {p.name: file_digest(p) for p in mine}}
            # one file per write thread, hashed as many at a time (hashlib lets go of the GIL)
            with ThreadPoolExecutor(min(self.write_threads, len(mine))) as pool:
                digests = list(pool.map(file_digest, mine))
            return {"files": {p.name: d for p, d in zip(mine, digests, strict=True)}}
        except OSError as e:
            return {"error": f"rank {self.rank} cannot hash its files: {e}"}

    def _publish_or_report(
        self, job: SaveJob, reports: list[DigestReport], begun: float
    ) -> tuple[Published | None, PublishStatus]:
        try:
            return self._publish(job, reports, begun), {}
        except Exception as e:  # reported to every rank, raised there
            log.error("publishing %s failed: %s", job.final.name, e)
            shutil.rmtree(job.tmp, ignore_errors=True)
            err = save_error(e, directory=self.directory, step=job.step, needed_bytes=job.needed_bytes)
            return None, {"error": err.message, "hint": err.hint}

    def _publish(self, job: SaveJob, reports: list[DigestReport], begun: float) -> Published:
        errors = [r["error"] for r in reports if r.get("error")]
        if errors:
            raise CheckpointError("; ".join(errors), where=str(job.tmp))
        if not (job.tmp / METADATA_NAME).is_file():
            raise CheckpointError("DCP finished without writing .metadata", where=str(job.tmp))
        files = collect_digests(job.tmp, reports)
        manifest = build_manifest(
            step=job.step,
            world_size=self.run.world_size,
            config_hash=self.run.config_hash,
            model_hash=self.run.model_hash,
            extra=job.extra,
            files=files,
            torch_version=_torch_version(),
        )
        atomic_write_json(job.tmp / MANIFEST_NAME, manifest)
        self._rename_into_place(job)
        self.checkpoints.mark_valid(job.step, job.final)
        self.checkpoints.apply_retention(protect={job.step}, loading=self.loading)
        seconds = time.monotonic() - begun
        return Published(job.step, str(job.final), int(manifest["total_bytes"]), seconds)

    def _rename_into_place(self, job: SaveJob) -> None:
        if job.final.exists():  # appeared since the decision (not ours): never overwrite it
            move_aside_corrupt(job.final)
        # rename() of a directory onto an existing non-empty one fails: never overwrites.
        os.rename(job.tmp, job.final)
        fsync_dir(self.directory)


class _NoClose:
    """The file a record is written into, minus ``close``: ``write`` is the buffered file's own
    method, so the many small writes of torch.save's record format go straight to C."""

    def __init__(self, raw: Any) -> None:
        self._raw = raw
        self.write = raw.write

    def flush(self) -> None:
        self._raw.flush()

    def close(self) -> None:  # DCP closes what it wrote a record into; the file stays open
        self._raw.flush()


@functools.cache
def direct_writer_class() -> type[Any]:
    """DCP's filesystem writer, minus a Python frame per write: without stream extensions DCP
    still wraps the file in a Python ``NoCloseWriter`` whose ``write`` runs for each of the ~36
    pieces torch.save writes a record in (cProfile: ~40 % of a save's CPU for a few hundred
    tensors). The bytes written are the same. With extensions, or a DCP without the hook, DCP's
    own path."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import filesystem

    base = getattr(filesystem, "_StorageWriterTransforms", None)

    class DirectWriter(dcp.FileSystemWriter):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            if base is not None and isinstance(self.transforms, base) and not self.transforms.extensions:
                self.transforms = _DirectTransforms()

    if base is None:
        return DirectWriter

    class _DirectTransforms(base):  # type: ignore[misc, valid-type]
        def transform_save_stream(self, write_item: Any, raw_stream: Any) -> tuple[Any, list[str]]:
            return _NoClose(raw_stream), []

    return DirectWriter


def collect_digests(tmp: Path, reports: list[DigestReport]) -> dict[str, tuple[int, str]]:
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
