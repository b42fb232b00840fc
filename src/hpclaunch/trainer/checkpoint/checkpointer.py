"""The Checkpointer: collective saves (blocking or in the background) and loads of one run.

Every rank constructs it at the same point and calls ``save``/``load_latest`` together. Rank 0
coordinates: it names the temporary directory, writes the manifest, publishes by rename + fsync,
applies retention, and chooses what to load; its verdicts reach the other ranks as JSON over a
gloo group of the checkpointer's own (background saves never share a collective order with the
training loop). See the package docstring for the layout and the state-dict conventions.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...errors import CheckpointError, FilesystemError
from ...fsutil import atomic_write_json, fsync_dir
from ...rundir import CHECKPOINT_SAVED, Ledger
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
from .faults import estimated_bytes as _estimated_bytes
from .manifest import (
    MANIFEST_NAME,
    METADATA_NAME,
    RANK_LOCAL,
    CheckpointInfo,
    InvalidCheckpoint,
    LoadResult,
    _jsonable,
    build_manifest,
    file_digest,
    move_aside_corrupt,
    scan_checkpoints,
    step_dir_name,
    verify_share,
)
from .reader import dcp_load
from .safe_load import safe_load_parts
from .save_plans import SavePlans

if TYPE_CHECKING:
    from concurrent.futures import Future, ThreadPoolExecutor

    import torch.distributed as dist

log = logging.getLogger("hpclaunch.trainer.checkpoint")


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
    blocking: bool
    extra: dict[str, Any]
    started: float  # time.monotonic() when save() was called
    needed_bytes: int  # about what the whole checkpoint takes on disk (for a "no space" message)


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
        writer_nice: int = 0,
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
        self.writer_nice = writer_nice
        self.ledger = ledger
        self.last_save_seconds: float | None = None
        self.last_stall_seconds: float | None = None
        self._pg, self._owns_pg = self._checkpoint_group(process_group)
        self._is_coordinator = rank == 0
        self._pending: Future[None] | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._stager: Any = None
        self._loading: set[int] = set()
        self._plans = SavePlans()
        self._dir = CheckpointDir(
            self.directory,
            world_size=world_size,
            config_hash=config_hash,
            model_hash=model_hash,
            keep_last=keep_last,
            keep_every=keep_every,
            ledger=ledger,
        )
        self._closed = False
        safe_load_parts()  # import DCP now, so the first save does not pay for it in its stall
        if self._is_coordinator:
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise save_error(e, directory=self.directory, step=0, needed_bytes=None) from None

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
        needed = _estimated_bytes(state, self.world_size, RANK_LOCAL)
        job = self._plan_save(
            step, blocking=blocking or not self.async_save, extra=extra, started=started, needed=needed
        )
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
        self, step: int, *, blocking: bool, extra: dict[str, Any] | None, started: float, needed: int
    ) -> _SaveJob | None:
        """Rank 0 decides (skip / write), names the temporary directory and checks ``extra``; its
        errors are raised on every rank, so none is left waiting in a collective."""
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
        return _SaveJob(step, tmp, final, blocking, decision["extra"], started, needed)

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
        """A published directory of this step is kept when valid (typically the stop save right
        after a periodic save of the same step: same state), else moved aside and saved again."""
        if not final.exists():
            return "write"
        if self._dir.is_valid(step, final):
            return "skip"
        return "write"  # is_valid moved it aside

    def _write_and_publish(self, job: _SaveJob, state: dict[str, Any]) -> None:
        """Every rank: DCP write, hash own files; rank 0: manifest + publish. Collective."""
        begun = time.monotonic()
        if threading.current_thread() is not threading.main_thread():
            set_thread_nice(self.writer_nice)
        delay_write_hook()
        self._dcp_save(job, state)
        kill_hook(job.step, self.rank, "publish")
        reports = all_gather_json(self._own_digests(job.tmp), self._pg)
        status: dict[str, Any] = {}
        if self._is_coordinator:
            status = self._publish_or_report(job, reports, begun)
        status = broadcast_json(status, self._pg, is_source=self._is_coordinator)
        if status.get("error"):
            raise CheckpointError(
                f"publishing failed: {status['error']}", where=str(job.final), hint=status.get("hint")
            )
        self.last_save_seconds = time.monotonic() - begun

    def _dcp_save(self, job: _SaveJob, state: dict[str, Any]) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        try:
            dcp.save(
                state,
                storage_writer=self._writer(job),
                planner=self._plans.planner(),
                process_group=self._pg,
                no_dist=self._pg is None,
            )
        except (Exception, CheckpointException) as e:  # DCP's is a BaseException
            self._plans.forget()  # the ranks' cached plans may be out of step now
            fs = is_filesystem_failure(e, directory=self.directory, needed_bytes=job.needed_bytes)
            if self._is_coordinator and fs:  # free the space a half-written save holds, then measure
                shutil.rmtree(job.tmp, ignore_errors=True)  # (a peer's death leaves it for the resume)
            raise save_error(e, directory=self.directory, step=job.step, needed_bytes=job.needed_bytes) from e

    def _writer(self, job: _SaveJob) -> Any:
        import torch.distributed.checkpoint as dcp

        fail = injected_failure(job.step, self.rank)
        if fail is not None or kill_requested(job.step, self.rank, "data"):
            return hooked_writer_class()(job.tmp, fail, lambda: kill_hook(job.step, self.rank, "data"))
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
            shutil.rmtree(job.tmp, ignore_errors=True)
            err = save_error(e, directory=self.directory, step=job.step, needed_bytes=job.needed_bytes)
            return {"error": err.message, "hint": err.hint}

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
        self._dir.mark_valid(job.step, job.final)
        self._dir.apply_retention(protect={job.step}, loading=self._loading)
        self._report_saved(job, manifest, time.monotonic() - begun)

    def _rename_into_place(self, job: _SaveJob) -> None:
        if job.final.exists():  # appeared since the decision (not ours): never overwrite it
            move_aside_corrupt(job.final)
        # rename() of a directory onto an existing non-empty one fails: never overwrites.
        os.rename(job.tmp, job.final)
        fsync_dir(self.directory)

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

    # ---- wait / close -------------------------------------------------------------------------

    def wait(self) -> None:
        """Finish (publish) a pending background save; re-raise its error."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def poll_background(self, group: dist.ProcessGroup | None) -> CheckpointError | None:
        """After every step, on every rank: has the background save failed? Its error, else None.

        Collective (a two-integer all-reduce on ``group``, the caller's host-side group, never
        ours: the save itself uses ours from its thread) but only while a save is pending, which
        every rank knows alike. A save that finished on every rank is settled; one that failed on
        any rank is reported on all of them at the same step.
        """
        if self._pending is None:
            return None
        done = self._pending.done()
        flags = [0 if done else 1, 1 if done and self._pending.exception() is not None else 0]
        if group is not None:
            import torch
            import torch.distributed as dist

            agreed = torch.tensor(flags, dtype=torch.int64)
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
            flags = [int(x) for x in agreed.tolist()]
        running, failed = flags
        if failed:
            try:
                self.wait()  # every rank's part has ended: the failure is collective in DCP
            except CheckpointError as e:
                return e
            except Exception as e:
                return CheckpointError(f"background save failed: {type(e).__name__}: {e}")
            return CheckpointError("the background save failed on another rank (see its log)")
        if not running:
            self.wait()
        return None

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
        self._plans.forget()
        if self._stager is not None:
            self._stager.close()
        if self._owns_pg and self._pg is not None:
            import torch.distributed as dist

            dist.destroy_process_group(self._pg)
        self._pg = None

    # ---- load ---------------------------------------------------------------------------------

    def _verify_shares(self, info: CheckpointInfo) -> str | None:
        """Every rank hashes its share of ``info``'s files (collective): None when all match, else
        the first mismatch. A share that cannot be read now raises FilesystemError on every rank."""
        import torch.distributed as dist

        rank = dist.get_rank(self._pg) if self._pg is not None else 0
        world = dist.get_world_size(self._pg) if self._pg is not None else 1
        verdicts = all_gather_json(_verify_share(info, rank, world), self._pg)
        unreadable = [v["filesystem"] for v in verdicts if v.get("filesystem")]
        if unreadable:
            raise FilesystemError(unreadable[0])
        invalid = [v["invalid"] for v in verdicts if v.get("invalid")]
        return invalid[0] if invalid else None

    def list_valid(self) -> list[CheckpointInfo]:
        """Valid checkpoints in DIR, newest last (reads and hashes files; call on one rank)."""
        return scan_checkpoints(self.directory)[0]

    def load_latest(self, state: dict[str, Any]) -> LoadResult | None:
        """Load the newest valid checkpoint into ``state`` in place; None when there is none.

        Collective. Rank 0 removes leftovers of killed writers, verifies newest-first and tells
        every rank which one to load; invalid newer ones are reported and skipped.
        """
        self.wait()
        skipped: list[tuple[Path, str]] = []  # newest first, in the order they were found bad
        while True:
            choice: dict[str, Any] = {}
            if self._is_coordinator:
                choice = self._dir.choose()
            choice = broadcast_json(choice, self._pg, is_source=self._is_coordinator)
            if choice.get("error"):
                raise (FilesystemError if choice.get("filesystem") else CheckpointError)(choice["error"])
            if choice.get("step") is None:
                return None
            skipped += [(Path(p), reason) for p, reason in choice["skipped"]]
            info = CheckpointInfo(
                step=int(choice["step"]),
                path=self.directory / choice["name"],
                manifest=choice["manifest"],
            )
            problem = self._verify_shares(info)
            if problem is None:
                break
            # A file whose sha256 does not match: the checkpoint is set aside, the next one tried.
            if self._is_coordinator:
                self._dir.set_aside(info.path, problem)
            skipped.append((info.path, problem))
        if self._is_coordinator:
            self._dir.mark_valid(info.step, info.path)
        self._loading.add(info.step)
        try:
            saved_ranks, sections = dcp_load(info, state, self._pg)
        finally:
            self._loading.discard(info.step)
        missing = sorted(set(range(self.world_size)) - saved_ranks)
        if self._is_coordinator:
            self._dir.report_rank_local(info, saved_ranks, missing)
        return LoadResult(
            info=info, skipped=skipped, ranks_without_rank_local=missing, saved_sections=sections
        )


def _verify_share(info: CheckpointInfo, rank: int, world: int) -> dict[str, Any]:
    try:
        verify_share(info, rank, world)
        return {}
    except InvalidCheckpoint as e:
        return {"invalid": str(e)}
    except FilesystemError as e:
        return {"filesystem": e.one_line()}


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


def set_thread_nice(added: int) -> None:
    """Run the calling thread at the process's niceness plus ``added`` (Linux: niceness is per
    thread, and the threads this one starts, DCP's writers included, inherit it). Elsewhere, or
    where the kernel refuses, the thread keeps its priority: a slower save, never a failed one."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError):
        base = os.getpriority(os.PRIO_PROCESS, os.getpid())  # the main thread's
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), min(19, base + added))


def _torch_version() -> str:
    import torch

    return str(torch.__version__)
