"""Background saves behind one small interface: the thread writer and the process writer.

Both stage the state in ``start`` (a copy in host memory that the next step may not touch) and then
write and publish it out of the training loop's way, with the code a blocking save runs
(``writing.SaveWriter``). They differ in where that happens and in how a rank learns the end:

- ``ThreadBackground`` (``checkpoint.writer: thread``): DCP's stager and one thread of the training
  process. Its DCP collectives run on the checkpointer's group from that thread, so the training
  thread never touches that group meanwhile; ``wait`` is local, since DCP fails every rank together.
  Its Python work takes the GIL from the training thread (``bench/checkpoint_stall.py``).
- ``ProcessBackground`` (``checkpoint.writer: process``): ``staging.SharedStager`` and one writer
  process per rank (``writer_process``). A writer that dies fails only its own rank, and its peers may
  wait for it in their group, so ``wait`` is collective: every rank reports (still writing? failed?)
  over the checkpointer's group, which nothing else uses in this mode, until all are done or one
  has failed; then every rank stops its writer and the next save starts fresh ones. An idle-priority
  writer that a waiting rank finds starved of CPU (``starvation``) is replaced, on every rank at
  once, by one at ``writer_nice`` that writes the same staged state again.
"""

from __future__ import annotations

import concurrent.futures
import logging
import shutil
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from ...errors import CheckpointError
from ...rundir import CHECKPOINT_SUPERSEDED, CHECKPOINT_WRITER_STARVED
from .directory import Finding
from .priority import set_thread_nice
from .starvation import StarvationWatch
from .writer_protocol import Answer, Failed, Saved, WriterSpec
from .writing import Published, SaveJob, SaveWriter

if TYPE_CHECKING:
    import torch.distributed as dist

    from .writer_process import WriterProcess

log = logging.getLogger("hpclaunch.rank.checkpoint")
WAIT_POLL_S = 0.2  # while waiting, ranks compare notes this often (one small all-reduce)


@dataclass
class Settled:
    """How a background save ended, on this rank."""

    job: SaveJob
    published: Published | None = None  # rank 0, when it published
    seconds: float | None = None  # the background write, start to end
    events: list[Finding] = field(default_factory=list)  # the writer's findings
    error: CheckpointError | None = None
    cpu_s: float | None = None  # the writer process's CPU time for it (process writer)


class ThreadBackground:
    kind = "thread"

    def __init__(self, writer: SaveWriter, *, nice: int) -> None:
        self._writer = writer
        self._nice = nice
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._stager: Any = None
        self._job: SaveJob | None = None
        self._future: concurrent.futures.Future[tuple[Published | None, float]] | None = None

    @property
    def pending(self) -> bool:
        return self._future is not None

    def start(self, job: SaveJob, state: dict[str, Any]) -> None:
        staged = self._stage(state)
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="hpclaunch-ckpt"
            )
        self._job = job
        self._future = self._executor.submit(self._run, job, staged)

    def _stage(self, state: dict[str, Any]) -> dict[str, Any]:
        """A CPU copy of ``state`` that training may not touch (DCP's own stager; it copies CPU
        tensors too and reuses its CPU buffers from one save to the next)."""
        import torch
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        if self._stager is None:
            _stager_copies_classes()
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

    def _run(self, job: SaveJob, staged: dict[str, Any]) -> tuple[Published | None, float]:
        set_thread_nice(self._nice)
        begun = time.monotonic()
        published = self._writer.write_and_publish(job, staged)
        return published, time.monotonic() - begun

    def flags(self) -> tuple[bool, int]:
        """(still writing here, FAILED here or 0), without waiting."""
        assert self._future is not None
        done = self._future.done()
        return not done, FAILED if done and self._future.exception() is not None else 0

    def wait(self) -> Settled:
        assert self._future is not None and self._job is not None
        future, job = self._future, self._job
        self._future = self._job = None
        try:
            published, seconds = future.result()
        except CheckpointError as e:
            return Settled(job, error=e)
        except Exception as e:
            return Settled(job, error=CheckpointError(f"background save failed: {type(e).__name__}: {e}"))
        return Settled(job, published, seconds)

    def supersede(self) -> Settled:
        """A thread cannot be stopped (it may hold DCP's collectives): the save is waited for."""
        return self.wait()

    def abort(self, *, writer_died: bool = False) -> Settled:
        """All ranks agreed that the save failed; here it has ended too (DCP failed it everywhere)."""
        settled = self.wait()
        if settled.error is None:
            settled.error = CheckpointError("the background save failed on another rank (see its log)")
        return settled

    def before_update(self) -> None:
        """Staging copied synchronously: nothing to wait for."""

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        if self._stager is not None:
            self._stager.close()


class ProcessBackground:
    kind = "process"

    def __init__(self, spec: WriterSpec, pg: dist.ProcessGroup | None) -> None:
        from .staging import SharedStager

        self._spec = spec
        self._pg = pg
        self._stager = SharedStager()
        self._proc: WriterProcess | None = None
        self._job: SaveJob | None = None
        self._staged: Any = None
        self._sent = False
        self._notes: list[Finding] = []  # ledger events of the save in flight

    @property
    def pending(self) -> bool:
        return self._job is not None

    @property
    def idle(self) -> bool:
        """Writers start at SCHED_IDLE (until one was found starved; then at writer_nice)."""
        return self._spec.idle

    @property
    def writer_pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self, job: SaveJob, state: dict[str, Any]) -> None:
        if self._proc is None:  # every rank starts its writer at the same save: one generation
            self._proc = self._new_writer(job)
        self._staged = self._stager.stage(state)
        self._job, self._sent = job, False
        self._dispatch(block=False)

    def _dispatch(self, *, block: bool) -> None:
        """Hand the save to the writer once its staging copies are done (CUDA: queued, not done)."""
        if self._job is None or self._sent or self._proc is None:
            return
        if not self._staged.ready():
            if not block:
                return
            self._staged.wait()
        self._proc.submit(self._job, self._staged)
        self._sent = True

    def _answer(self, timeout: float | None) -> Answer | None:
        assert self._proc is not None
        self._dispatch(block=timeout != 0.0)
        return self._proc.poll(timeout)

    def flags(self) -> tuple[bool, int]:
        """(still writing here, how it failed here: 0, FAILED, or WRITER_DIED)."""
        return _flags(self._answer(0.0))

    def wait(self) -> Settled:
        watch = self._starvation_watch()
        while True:
            polling = self._pg is not None or watch is not None
            running, failed = _flags(self._answer(WAIT_POLL_S if polling else None))
            starved = running and watch is not None and watch.starved()
            if self._pg is not None:
                agreed = _agree_max([running, failed, starved], self._pg)
                running, failed, starved = bool(agreed[0]), agreed[1], bool(agreed[2])
            if failed:
                return self.abort(writer_died=failed == WRITER_DIED)
            if not running:
                return self._settle()
            if starved:
                settled = self._replace_starved_writer(watch)
                if settled is not None:
                    return settled
                watch = None

    def _starvation_watch(self) -> StarvationWatch | None:
        """While a rank waits for an idle-priority writer, watch whether it gets any CPU at all."""
        if not self.idle or self._proc is None:
            return None
        return StarvationWatch(self._proc.pid)

    def _replace_starved_writer(self, watch: StarvationWatch | None) -> Settled | None:
        """Every rank agreed that some writer is starved: every rank stops its writer and starts one
        at ``writer_nice`` (a process cannot raise its own priority again) that writes the same
        staged state under a new temporary name; the half-written directory is removed. A save the
        starved writers published after all (a writer starved between the rename and its answer) is
        settled as published instead (the Settled)."""
        assert self._proc is not None and self._job is not None
        old, nice = self._job, self._spec.nice
        kept = self._stop_writers(old)
        if kept is not None:
            return kept
        share = watch.starved_share if watch is not None else None  # None: another rank's writer
        log.warning(
            "checkpoint writer: the save of step %d was starved of CPU at idle priority (%s: other "
            "processes keep every core busy); writing it again at nice +%d",
            old.step,
            f"this rank's writer waited for a core {share:.0%} of the time" if share else "on another rank",
            nice,
        )
        self._notes.append(
            (CHECKPOINT_WRITER_STARVED, {"step": old.step, "run_queue_share": share, "nice": nice})
        )
        self._spec = replace(self._spec, idle=False)
        # a new hex nonce (the leftover pattern) and so a new generation of writers and their store prefix
        self._job = replace(old, tmp=old.tmp.with_name(old.tmp.name + "0"))
        self._sent = False
        self._proc = self._new_writer(self._job)
        self._dispatch(block=True)
        return None

    def _stop_writers(self, old: SaveJob) -> Settled | None:
        """Every rank stops its writer in the middle of ``old`` (collective). A save the writers
        published after all (stopped between the rename and their answer) is settled as published
        (the Settled); else the coordinator removes its half-written directory (None)."""
        assert self._proc is not None
        answer = self._proc.poll(0.0)  # this rank's writer may have finished its part meanwhile
        self._proc.kill()
        self._proc = None
        coordinator = self._spec.rank == 0
        published = coordinator and old.final.is_dir()
        if self._pg is not None:  # also: every rank's writer is gone before the cleanup below
            published = bool(_agree_max([published], self._pg)[0])
        if published:
            return self._settle_published_meanwhile(old, answer if coordinator else None)
        if coordinator:
            shutil.rmtree(old.tmp, ignore_errors=True)
        return None

    def _settle_published_meanwhile(self, job: SaveJob, answer: Answer | None) -> Settled:
        """The coordinator's writer published ``job`` before it was stopped: settle it as saved (the
        coordinator with what was published: its writer's answer, or the directory itself)."""
        self._job = self._staged = None
        if isinstance(answer, Saved):
            return self._settled(job, answer)
        notes = self._take_notes()
        seconds = time.monotonic() - job.started
        if self._spec.rank != 0:
            return Settled(job, None, seconds, notes)
        size = sum(f.stat().st_size for f in job.final.iterdir() if f.is_file())
        return Settled(job, Published(job.step, str(job.final), size, seconds), seconds, notes)

    def _new_writer(self, job: SaveJob) -> WriterProcess:
        from .writer_process import WriterProcess

        generation = job.tmp.name.rsplit("tmp-", 1)[-1]
        return WriterProcess(replace(self._spec, generation=generation))

    def _take_notes(self) -> list[Finding]:
        notes, self._notes = self._notes, []
        return notes

    def finish_alone(self, timeout: float) -> Settled:
        """This rank's writer's answer without asking the other ranks (``close``: a save is still
        pending only when this rank is leaving on an error, and the others may never come to a
        collective); a writer that has not answered within ``timeout`` is stopped."""
        answer = self._answer(timeout)
        if not isinstance(answer, Saved):
            settled = self.abort()
            if answer is None:
                settled.error = CheckpointError(
                    f"the background save did not finish within {timeout:g} s of closing; abandoned"
                )
            return settled
        return self._settle()

    def _settle(self) -> Settled:
        assert self._proc is not None and self._job is not None
        answer, job = self._proc.take(), self._job
        assert isinstance(answer, Saved)  # (settled only when no rank's writer failed)
        self._job = self._staged = None
        return self._settled(job, answer)

    def _settled(self, job: SaveJob, answer: Saved) -> Settled:
        """A save as its writer's "saved" answer tells it (with our notes of it first)."""
        return Settled(
            job, answer.published, answer.seconds, [*self._take_notes(), *answer.events], cpu_s=answer.cpu_s
        )

    def supersede(self) -> Settled:
        """A stop saves a newer step now: a save still writing on any rank is dropped instead of
        waited for (its writer may be starved of CPU at idle priority, or still starting: seconds
        the stop does not have before the deadline). Every rank stops its writer; the coordinator
        keeps a save published meanwhile, else removes its half-written directory. A save finished
        (or failed) on every rank settles as ``wait`` would."""
        assert self._proc is not None and self._job is not None
        running, failed = _flags(self._answer(0.0))
        if self._pg is not None:
            agreed = _agree_max([int(running), failed], self._pg)
            running, failed = bool(agreed[0]), agreed[1]
        if failed:
            return self.abort(writer_died=failed == WRITER_DIED)
        if not running:
            return self._settle()
        old = self._job
        kept = self._stop_writers(old)
        if kept is not None:
            return kept
        self._notes.append((CHECKPOINT_SUPERSEDED, {"step": old.step, "writer": "process"}))
        self._job = self._staged = None
        return Settled(old, None, None, self._take_notes())

    def abort(self, *, writer_died: bool = False) -> Settled:
        """Every rank agreed that the save failed: say why (ours, or another rank's), stop our writer
        (it may be waiting for a peer that is gone); the next background save starts a new one.
        ``writer_died``: some rank's writer died, which is then the reason on every rank (the others'
        writers only fail because a peer went, in gloo's words)."""
        assert self._proc is not None and self._job is not None
        answer, job = self._proc.poll(0.0), self._job
        settled = Settled(job, events=self._take_notes())
        own = answer if isinstance(answer, Failed) else None  # this rank's writer's failure
        if own is not None and (own.dead or not writer_died):
            settled.error = CheckpointError(own.message, where=own.where, hint=own.hint)
        elif writer_died:
            settled.error = CheckpointError(
                f"the checkpoint writer process of another rank died while saving step {job.step} "
                "(see that rank's log)",
                hint="the save is retried in the training process",
            )
        else:
            settled.error = CheckpointError("the background save failed on another rank (see its log)")
        if own is not None:
            settled.events += own.events
        self._proc.kill()
        self._proc = None
        self._job = self._staged = None
        return settled

    def before_update(self) -> None:
        self._stager.before_update()

    def close(self) -> None:
        if self._proc is not None:
            self._proc.close()
            self._proc = None
        self._stager.close()


FAILED = 1
WRITER_DIED = 2  # ranks over FAILED in the all-reduce's MAX: a dead writer names the cause


def _flags(answer: Answer | None) -> tuple[bool, int]:
    if answer is None:
        return True, 0
    if isinstance(answer, Saved):
        return False, 0
    return False, WRITER_DIED if answer.dead else FAILED


def agree(running: bool, failed: int, pg: dist.ProcessGroup) -> tuple[bool, int]:
    """(writing on any rank, the worst failure on any rank): a two-integer all-reduce over ``pg``."""
    agreed = _agree_max([running, failed], pg)
    return bool(agreed[0]), int(agreed[1])


def _agree_max(values: list[int], pg: dist.ProcessGroup) -> list[int]:
    """Each value's maximum over the ranks of ``pg`` (booleans as 0/1): one small all-reduce."""
    import torch
    import torch.distributed as dist

    flags = torch.tensor([int(v) for v in values], dtype=torch.int64)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=pg)
    return [int(v) for v in flags]


def _stager_copies_classes() -> None:
    """Give DCP's state-dict stager a copier for classes where it lacks one.

    The stager deep-copies a DTensor's spec (its mesh, placements, ...) and, on meeting a class
    there, looks up ``type`` in its copy table: torch 2.11 (seen on an H200 with FSDP2 and the
    thread writer) has no entry and fails every background save with ``KeyError: <class 'type'>``;
    2.13 has one (a class is copied as itself). Adding the same entry to each new stager is all
    this does; a torch without the private module, or with the entry, is left alone.
    """
    try:
        from torch.distributed.checkpoint import _state_dict_stager as module
    except ImportError:
        return
    cls = getattr(module, "StateDictStager", None)
    if cls is None or getattr(cls, "_hpclaunch_copies_classes", False):
        return
    init = cls.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        table = getattr(self, "_deepcopy_dispatch", None)
        if isinstance(table, dict) and type not in table:

            def _deepcopy_atomic(x: Any, memo: Any, non_blocking: bool = False) -> Any:
                return x  # (the name is how the stager tells an atomic copier)

            table[type] = _deepcopy_atomic

    cls.__init__ = __init__
    cls._hpclaunch_copies_classes = True
