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
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...errors import CheckpointError
from ...fsutil import atomic_write_json, fsync_dir
from ..dist import all_gather_json, broadcast_json
from .directory import CheckpointDir
from .faults import (
    delay_write_hook,
    hooked_writer_class,
    injected_failure,
    is_filesystem_failure,
    kill_hook,
    kill_requested,
    save_error,
)
from .manifest import MANIFEST_NAME, METADATA_NAME, build_manifest, file_digest, move_aside_corrupt
from .save_plans import SavePlans

if TYPE_CHECKING:
    import torch.distributed as dist

log = logging.getLogger("hpclaunch.trainer.checkpoint")


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

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "tmp": str(self.tmp), "final": str(self.final)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SaveJob:
        return cls(**{**data, "tmp": Path(data["tmp"]), "final": Path(data["final"])})


@dataclass(frozen=True)
class Published:
    """What the coordinator published (the other ranks get None)."""

    step: int
    path: str
    bytes: int
    seconds: float  # from the start of the write to the end of retention


def quiet_dcp_logger() -> None:
    """DCP logs every call of its methods at DEBUG to a logger with only a NullHandler: records
    built for nobody, ~15 ms of CPU per save of a few hundred tensors (cProfile). Raise its level."""
    from torch.distributed.checkpoint import logger as dcp_logger

    quiet = getattr(dcp_logger, "_dcp_logger", None)
    if isinstance(quiet, logging.Logger) and all(isinstance(h, logging.NullHandler) for h in quiet.handlers):
        quiet.setLevel(logging.WARNING)


class SaveWriter:
    """Writes and publishes saves of one checkpoint directory from one rank (collective over ``pg``)."""

    def __init__(
        self,
        directory: Path,
        *,
        rank: int,
        world_size: int,
        config_hash: str,
        model_hash: str,
        checkpoints: CheckpointDir,
        plans: SavePlans,
        pg: dist.ProcessGroup | None,
        in_writer_process: bool = False,
        before_write: Callable[[], None] | None = None,
    ) -> None:
        self.directory = directory
        self.rank = rank
        self.world_size = world_size
        self.config_hash = config_hash
        self.model_hash = model_hash
        self.checkpoints = checkpoints
        self.plans = plans
        self.pg = pg
        self.in_writer_process = in_writer_process
        self.before_write = before_write
        self.loading: set[int] = set()
        self._digests: dict[str, tuple[int, str]] = {}
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
        delay_write_hook()
        self._dcp_save(job, state, planner_attrs)
        kill_hook(job.step, self.rank, "publish", in_writer_process=self.in_writer_process)
        reports = all_gather_json(self._own_digests(job.tmp), self.pg)
        status: dict[str, Any] = {}
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
        fail = injected_failure(job.step, self.rank)
        self._digests = {}
        if fail is not None or kill_requested(job.step, self.rank, "data"):
            return hooked_writer_class()(
                job.tmp,
                fail,
                lambda: kill_hook(job.step, self.rank, "data", in_writer_process=self.in_writer_process),
            )
        writer = digesting_writer_class()(job.tmp, sync_files=True, overwrite=False)
        self._digests = writer.fs.digests
        return writer

    def _own_digests(self, tmp: Path) -> dict[str, Any]:
        """Sizes and sha256 of the data files this rank wrote (ranks hash in parallel): as they were
        written (``digesting_writer_class``), else read back; a size that differs is read back."""
        import torch.distributed as dist

        group_rank = dist.get_rank(self.pg) if self.pg is not None else 0
        try:
            files = {}
            for p in sorted(tmp.glob(f"__{group_rank}_*.distcp")):
                known = self._digests.get(p.name)
                files[p.name] = list(known if known and known[0] == p.stat().st_size else file_digest(p))
            return {"files": files}
        except OSError as e:
            return {"error": f"rank {self.rank} cannot hash its files: {e}"}

    def _publish_or_report(
        self, job: SaveJob, reports: list[Any], begun: float
    ) -> tuple[Published | None, dict[str, Any]]:
        try:
            return self._publish(job, reports, begun), {}
        except Exception as e:  # reported to every rank, raised there
            log.error("publishing %s failed: %s", job.final.name, e)
            shutil.rmtree(job.tmp, ignore_errors=True)
            err = save_error(e, directory=self.directory, step=job.step, needed_bytes=job.needed_bytes)
            return None, {"error": err.message, "hint": err.hint}

    def _publish(self, job: SaveJob, reports: list[Any], begun: float) -> Published:
        errors = [r["error"] for r in reports if r.get("error")]
        if errors:
            raise CheckpointError("; ".join(errors), where=str(job.tmp))
        if not (job.tmp / METADATA_NAME).is_file():
            raise CheckpointError("DCP finished without writing .metadata", where=str(job.tmp))
        files = collect_digests(job.tmp, reports)
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


@functools.cache
def digesting_writer_class() -> type[Any]:
    """DCP's filesystem writer whose files are hashed as they are written: the bytes are hashed
    while they are at hand instead of read back afterwards (a second pass over the checkpoint's
    memory). DCP writes each file front to back through ``write``; anything else (a seek) refuses."""
    import hashlib
    import io
    from collections.abc import Iterator
    from contextlib import contextmanager

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import FileSystem

    class DigestingStream(io.RawIOBase):
        def __init__(self, raw: Any) -> None:
            self.raw, self.sha, self.size = raw, hashlib.sha256(), 0

        def writable(self) -> bool:
            return True

        def write(self, b: Any) -> int:
            view = memoryview(b).cast("B")
            n = self.raw.write(view)
            n = len(view) if n is None else n
            self.sha.update(view[:n])
            self.size += n
            return n

        def tell(self) -> int:
            return int(self.raw.tell())

        def seek(self, *args: Any) -> int:
            raise io.UnsupportedOperation("a hashed checkpoint file is written front to back")

        def fileno(self) -> int:
            self.raw.flush()  # DCP fsyncs the descriptor without flushing the buffered file first
            return int(self.raw.fileno())

        def flush(self) -> None:
            self.raw.flush()

    class DigestingFileSystem(FileSystem):
        def __init__(self) -> None:
            super().__init__()
            self.digests: dict[str, tuple[int, str]] = {}

        @contextmanager
        def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
            with super().create_stream(path, mode) as stream:
                if "w" not in mode:
                    yield stream
                    return
                hashed = DigestingStream(stream)
                yield hashed
                stream.flush()
                self.digests[Path(path).name] = (hashed.size, hashed.sha.hexdigest())

    class DigestingWriter(dcp.FileSystemWriter):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.fs = DigestingFileSystem()

    return DigestingWriter


def collect_digests(tmp: Path, reports: list[Any]) -> dict[str, tuple[int, str]]:
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
