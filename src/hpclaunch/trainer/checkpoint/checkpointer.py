"""The Checkpointer: collective saves (blocking or in the background) and loads of one run.

Every rank constructs it at the same point and calls ``save``/``load_latest`` together. Rank 0
coordinates: it names the temporary directory, writes the manifest, publishes by rename + fsync,
applies retention, and chooses what to load; its verdicts reach the other ranks as JSON over a
gloo group of the checkpointer's own (background saves never share a collective order with the
training loop). See the package docstring for the layout and the state-dict conventions.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import signal
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...errors import CheckpointError
from ...fsutil import atomic_write_json, fsync_dir
from ...rundir import CHECKPOINT_INVALID, CHECKPOINT_SAVED, Ledger
from ..dist import all_gather_json, broadcast_json
from .manifest import (
    MANIFEST_NAME,
    METADATA_NAME,
    RANK_LOCAL,
    CheckpointInfo,
    InvalidCheckpoint,
    LoadResult,
    _jsonable,
    _ranks_with_rank_local,
    build_manifest,
    file_digest,
    leftover_dirs,
    leftover_reason,
    newest_valid,
    published_dirs,
    read_manifest,
    scan_checkpoints,
    step_dir_name,
    steps_to_delete,
)
from .safe_load import load_metadata_safely, safe_load_parts

if TYPE_CHECKING:
    from concurrent.futures import Future, ThreadPoolExecutor

    import torch.distributed as dist

log = logging.getLogger("hpclaunch.trainer.checkpoint")

ENV_DELAY_WRITE = "HPCLAUNCH_TEST_CKPT_DELAY_WRITE_S"
ENV_KILL = "HPCLAUNCH_TEST_CKPT_KILL"


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
        safe_load_parts()  # import DCP now, so the first save does not pay for it in its stall
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
        decision = broadcast_json(decision, self._pg, is_source=self._is_coordinator)
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
        reports = all_gather_json(self._own_digests(job.tmp), self._pg)
        status: dict[str, Any] = {}
        if self._is_coordinator:
            status = self._publish_or_report(job, reports, begun)
        status = broadcast_json(status, self._pg, is_source=self._is_coordinator)
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
            return _hooked_writer_class()(job.tmp, lambda: _test_kill(job.step, self.rank, "data"))
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
        choice = broadcast_json(choice, self._pg, is_source=self._is_coordinator)
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

        parts = safe_load_parts()
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
        errors = [msg for msg in all_gather_json(error and error.one_line(), self._pg) if msg]
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


@functools.cache
def _hooked_writer_class() -> type[Any]:
    """Test-only DCP writer that SIGKILLs this rank after its data files are written (ENV_KILL)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
    from torch.distributed.checkpoint.storage import WriteResult
    from torch.futures import Future as TorchFuture

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

    return HookedWriter
