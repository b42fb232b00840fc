"""The Checkpointer: collective saves (blocking or in the background) and loads of one run.

Every rank constructs it at the same point and calls ``save``/``load_latest`` together. Rank 0
coordinates: it names the temporary directory, writes the manifest, publishes by rename + fsync,
applies retention, and chooses what to load; its verdicts reach the other ranks as JSON over a
gloo group of the checkpointer's own (background saves never share a collective order with the
training loop). See the package docstring for the layout and the state-dict conventions.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from ...errors import CheckpointError
from ...rundir import Ledger
from ...rundir.checkpoint_manifest import RANK_LOCAL, CheckpointInfo, LoadResult, scan_checkpoints
from .background import WRITER_DIED, ProcessBackground, Settled, ThreadBackground, agree
from .directory import CheckpointDir, RunCheckpoints
from .group import checkpoint_group
from .resume import load_latest
from .safe_load import safe_load_parts
from .save_decision import plan_save
from .save_errors import estimated_bytes as _estimated_bytes
from .save_errors import save_error
from .save_plans import SavePlans
from .save_report import report_saved
from .writer_protocol import WriterSpec
from .writing import Published, SaveJob, SaveWriter

if TYPE_CHECKING:
    import torch.distributed as dist

Writer = Literal["process", "thread"]
CLOSE_WAIT_S = 60.0  # close(): how long a pending background save may still take (see close)


@dataclass(frozen=True)
class WriterSettings:
    """How this rank writes its saves (``checkpoint.async_save``, ``writer``, ``writer_nice``,
    ``writer_idle`` and ``write_threads`` resolved to a number). The trainer sets every field from its config; the defaults serve tests
    and benchmarks."""

    async_save: bool = True  # False: every save blocks
    writer: Writer = "process"  # where background saves are written (see Checkpointer)
    nice: int = 0
    idle: bool = True  # the writer process starts at SCHED_IDLE
    write_threads: int = 1

    def __post_init__(self) -> None:
        if self.writer not in ("process", "thread"):
            raise CheckpointError(f"writer must be 'process' or 'thread', got {self.writer!r}")


class Checkpointer:
    """Saves and loads this run's checkpoints; construct it on all ranks at the same point.

    ``writing.writer``: where background saves are written (``background``): ``process`` (a writer
    process per rank, fed through shared memory) or ``thread`` (a thread of this process).
    """

    def __init__(
        self,
        run: RunCheckpoints,
        *,
        rank: int,
        writing: WriterSettings = WriterSettings(),
        ledger: Ledger | None = None,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.run = run
        self.directory = run.directory
        self.rank = rank
        self.world_size = run.world_size
        self.writing = writing
        self.ledger = ledger
        self.last_save_seconds: float | None = None
        self.last_stall_seconds: float | None = None
        self.last_save_written = False  # the last save() wrote (or started writing) a checkpoint
        self.last_writer_cpu_seconds: float | None = None  # the writer process's, last save (bench)
        # Where the last save()'s time went: waiting for the previous save, rank 0's decision (a
        # broadcast), and for a background save the staging copy (the writer's start included).
        self.last_stall_parts: dict[str, float] = {}
        self.settled_saves = 0  # background saves settled so far (the same count on every rank)
        self._pg, self._owns_pg = checkpoint_group(process_group, rank=rank, world_size=run.world_size)
        self._is_coordinator = rank == 0
        self._plans = SavePlans()
        self._dir = CheckpointDir(run, ledger=ledger)
        self._writer = SaveWriter(
            self._dir, rank=rank, plans=self._plans, pg=self._pg, write_threads=writing.write_threads
        )
        self._background: ThreadBackground | ProcessBackground | None = None
        self._closed = False
        safe_load_parts()  # import DCP now, so the first save does not pay for it in its stall
        if self._is_coordinator:
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise save_error(e, directory=self.directory, step=0, needed_bytes=None) from None

    @property
    def pending(self) -> bool:
        """A background save is in flight (the same on every rank)."""
        return self._background is not None and self._background.pending

    @property
    def writer_pid(self) -> int | None:
        """This rank's writer process, while there is one (tests, diagnostics)."""
        bg = self._background
        return bg.writer_pid if isinstance(bg, ProcessBackground) else None

    # ---- set-up -------------------------------------------------------------------------------

    def _make_background(self) -> ThreadBackground | ProcessBackground:
        w = self.writing
        if w.writer == "thread":
            return ThreadBackground(self._writer, nice=w.nice)
        from .writer_process import store_address

        spec = WriterSpec(
            rank=self.rank,
            checkpoints=self.run,
            nice=w.nice,
            idle=w.idle,
            write_threads=w.write_threads,
            store=store_address(self.world_size),
        )
        return ProcessBackground(spec, self._pg)

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
        waited = time.monotonic()
        needed = _estimated_bytes(state, self.world_size, RANK_LOCAL)
        job = plan_save(
            step,
            self._writer,
            blocking=blocking or not self.writing.async_save,
            extra=extra,
            started=started,
            needed=needed,
        )
        planned = time.monotonic()
        self.last_save_written = job is not None
        self.last_stall_parts = {"wait": waited - started, "plan": planned - waited}
        if job is None:
            self.last_stall_seconds = time.monotonic() - started
            return
        if job.blocking:
            published = self._writer.write_and_publish(job, state)
            self.last_save_seconds = time.monotonic() - planned
            self.last_stall_seconds = time.monotonic() - started
            self._report_saved(job, published)
            return
        if self._background is None:
            self._background = self._make_background()
        self._background.start(job, state)
        self.last_stall_seconds = time.monotonic() - started
        self.last_stall_parts["stage"] = time.monotonic() - planned

    def before_update(self) -> None:
        """Call before the optimizer changes the live tensors: on CUDA the staging copies of a save
        just started run beside the next forward and backward, and the update waits for them on
        the GPU (never on the host). Nothing to do on CPU, or with the thread writer."""
        if self._background is not None:
            self._background.before_update()

    def _report_saved(self, job: SaveJob, published: Published | None) -> None:
        """Rank 0: the log line and the ledger's ``checkpoint_saved`` of a published save."""
        report_saved(
            job,
            published,
            checkpoints=self._dir,
            ledger=self.ledger,
            writer=self.writing.writer,
            background_stall_s=self.last_stall_seconds,
        )

    # ---- wait / close -------------------------------------------------------------------------

    def wait(self, *, supersede: bool = False) -> None:
        """Finish (publish) a pending background save; raise its error. Every rank calls it at the
        same point (with the process writer it is collective: ranks wait for each other's writers).
        ``supersede``: drop it instead where it is still writing (``ProcessBackground.supersede``)."""
        if self.pending:
            assert self._background is not None
            self._settle(self._background.supersede() if supersede else self._background.wait())

    def _settle(self, settled: Settled) -> None:
        self.settled_saves += 1
        if self.ledger is not None:
            for name, fields in settled.events:  # what the writer process found (retention)
                self.ledger.append(name, **fields)
        if settled.error is not None:
            self._plans.forget()
            raise settled.error
        if settled.seconds is not None:  # (None: superseded, nothing was measured)
            self.last_save_seconds = settled.seconds
            self.last_writer_cpu_seconds = settled.cpu_s
        self._report_saved(settled.job, settled.published)

    def poll_background(self, group: dist.ProcessGroup | None) -> CheckpointError | None:
        """After every step, on every rank: has the background save failed? Its error, else None.

        Collective (a two-integer all-reduce on ``group``, the caller's host-side group, never
        ours: the thread writer uses ours from its thread) but only while a save is pending, which
        every rank knows alike. A save that finished on every rank is settled; one that failed on
        any rank is reported on all of them at the same step (and with the process writer, every
        rank's writer is stopped: the next background save starts new ones).
        """
        if not self.pending:
            return None
        assert self._background is not None
        running, failed = self._background.flags()
        if group is not None:
            running, failed = agree(running, failed, group)
        if failed:
            try:
                self._settle(self._background.abort(writer_died=failed == WRITER_DIED))
            except CheckpointError as e:
                return e
        elif not running:
            self.wait()
        return None

    def close(self) -> None:
        """Wait for a pending save, then release the writer, staging buffers and our group.

        A run's last save waits for the background one, so a save is pending here only when the
        rank leaves on an error, maybe alone: the process writer's answer is then awaited without
        a collective (the thread writer's wait never was one)."""
        if self._closed:
            return
        self._closed = True
        try:
            bg = self._background
            if isinstance(bg, ProcessBackground) and bg.pending:
                self._settle(bg.finish_alone(CLOSE_WAIT_S))
            else:
                self.wait()
        finally:
            self._teardown()

    def _teardown(self) -> None:
        if self._background is not None:
            self._background.close()
            self._background = None
        if self.writing.writer == "process":
            from .writer_process import discard_waiting

            discard_waiting()  # a forked writer no background save took
        self._plans.forget()
        if self._owns_pg and self._pg is not None:
            import torch.distributed as dist

            # (a script may have destroyed every group itself, ours with them)
            with contextlib.suppress(ValueError, RuntimeError):
                if dist.is_initialized():
                    dist.destroy_process_group(self._pg)
        self._pg = None

    # ---- load ---------------------------------------------------------------------------------

    def list_valid(self) -> list[CheckpointInfo]:
        """Valid checkpoints in DIR, newest last (reads and hashes files; call on one rank)."""
        return scan_checkpoints(self.directory)[0]

    def load_latest(self, state: dict[str, Any]) -> LoadResult | None:
        """Load the newest valid checkpoint into ``state`` in place; None when there is none.

        Collective. Rank 0 removes leftovers of killed writers, verifies newest-first and tells
        every rank which one to load; invalid newer ones are reported and skipped (``loading``).
        """
        self.wait()
        return load_latest(
            state,
            checkpoints=self._dir,
            world_size=self.world_size,
            pg=self._pg,
            is_coordinator=self._is_coordinator,
            loading=self._writer.loading,
        )
