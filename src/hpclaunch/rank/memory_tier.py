"""The memory tier: snapshots of the training state in the nodes' shared memory, between the
checkpoints on disk, each rank's shard also on a peer node, so that a crash, a hang or a node's
death restarted in place loses seconds, not an interval.

Every ``checkpoint.memory.every_steps`` steps each rank stages its state (the staging copy: the
stall) and a thread of the rank writes it into its node's tmpfs (``/dev/shm/hpclaunch-<uid>/<run id>/<node>/alloc-<id>``,
private to the user, unless ``checkpoint.memory.dir`` says otherwise; ``rundir.shm``) and sends it to its buddy on the next node, which
keeps it in its own (``snapshots.transfer``). A snapshot is rank-local (``snapshots``): no DCP plan,
no collective while training.

After an in-place restart, ``restore`` gathers what every node of the roster holds (one
``all_gather``), and every rank computes the same plan: the newest snapshot newer than the disk's
newest checkpoint of which every rank's shard is still held somewhere (its own node's copy, or its
buddy's when its node died and a spare took its place). The spare's ranks are sent their shards by a
node that holds them. Else the disk tier serves, and the ledger's ``resumed`` says why. A snapshot
never replaces a disk save: a stop's save (preemption, the time limit, a user stop) and the periodic
ones still go to disk, and memory does not outlive the allocation: the snapshots are removed when the
trainer ends with its last save on disk.
"""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple, TypedDict

from ..config import RunConfig
from ..errors import CheckpointError, FilesystemError
from ..rundir import SNAPSHOT_FAILED, SNAPSHOT_SAVED, Ledger, RunPaths, read_events
from ..rundir.checkpoint_manifest import newest_valid
from ..rundir.env import ALLOCATION_VAR, ATTEMPT_VAR, NODE_NAME_VAR
from ..rundir.kinds import SNAPSHOT_INTERVAL
from ..rundir.shm import TierPlaceError, base_of, run_root, sweep
from .checkpoint.save_interval import ledger_failures, run_mtbf_s
from .checkpoint.staging import SharedStager, Staged
from .dist import DistContext, broadcast_json
from .snapshots import shard
from .snapshots.buddies import buddy_of, ward_of
from .snapshots.restoring import fill_from_plan, gather_plan, words_of
from .snapshots.shard import State
from .snapshots.snapshot_interval import CostMeter, SnapshotSchedule
from .snapshots.store import NodeStore
from .snapshots.transfer import (
    JobThread,
    SnapshotJob,
    SnapshotPlace,
    new_link,
)

# A job's waits on its peers, each ended by gloo's timeout: the sizes, the word, the shards, and one
# for its own staging and writes.
DRAIN_WAITS = 4


def snapshot_dir(cfg: RunConfig, paths: RunPaths) -> Path:
    """Where this run's snapshots live: the user's private root in the tmpfs, one directory per run
    directory, one below it per node (``rundir.shm``)."""
    return run_root(cfg.checkpoint.memory, paths)


def node_name() -> str:
    """This node as the scheduler names it (the node agent says), else its host name."""
    return os.environ.get(NODE_NAME_VAR) or socket.gethostname().split(".")[0]


class StallFields(TypedDict):
    """What a snapshot cost the training loop (its ``snapshot_saved`` line)."""

    stall_s: float
    stall_parts: dict[str, float]
    bytes: int


class TierFields(TypedDict, total=False):
    """What ``resumed`` says of the tiers."""

    disk_step: int | None
    tier: str
    memory_reason: str
    shards_from: dict[str, list[int]]


class Restored(NamedTuple):
    """A restore from memory: the step, the state's sections the shard held, where it came from."""

    step: int
    saved_sections: set[str]
    path: str
    ranks_without_rank_local: frozenset[int] = frozenset()  # (a shard always holds its rank's own)


class MemoryTier:
    """One rank's memory tier: when to snapshot, its node's store, its buddy, what they cost.

    The tier never stalls training for long and never fails it: a snapshot that cannot be written
    (no room, no place, a peer gone) is said once per rank and attempt (``snapshot_failed`` and a line
    on the rank's stderr) and the disk tier serves; a job still running ``wait_s`` after it began when
    the loop must wait for it (the next snapshot, a stop's save) makes the tier step aside for the
    rest of the attempt. Only a bug in a job (not an operating-system or transport error) fails the
    rank, re-raised in the loop."""

    def __init__(
        self,
        cfg: RunConfig,
        ctx: DistContext,
        paths: RunPaths,
        ledger: Ledger | None,
        *,
        ranks_on_node: int,
        hashes: dict[str, str],
    ) -> None:
        m = cfg.checkpoint.memory
        assert m.every_steps is not None
        self.keep_last, self.wait_s = m.keep_last, float(m.wait_s)
        self.cfg = cfg
        self.ctx = ctx
        self.paths = paths
        self.ledger = ledger
        self.attempt = ledger.attempt if ledger is not None else os.environ.get(ATTEMPT_VAR) or "local"
        self.root = snapshot_dir(cfg, paths)
        self.node = node_name()
        self.failures = 0  # snapshots of this rank that failed in this attempt (the first is said)
        self.off: str | None = None  # why the tier stepped aside for the rest of the attempt
        self.store: NodeStore | None = None
        base = base_of(cfg.checkpoint.memory)
        try:
            self.store = NodeStore(self.root, base, self.node, os.environ.get(ALLOCATION_VAR))
            if ctx.local_rank == 0:  # memory does not outlive an allocation: what ended ones of this
                sweep(base, self.store.directory.parent)  # run left on this node (the agent: all)
        except (OSError, TierPlaceError) as e:  # (the rank still trades with its buddy and ward)
            self._fail(None, f"the memory tier has no place on node {self.node}: {words_of(e)}")
        self.hashes = dict(hashes)  # (config_hash, model_hash: a snapshot of another model never loads)
        replicated = m.replicas > 0
        buddy = buddy_of(ctx.rank, ranks_on_node, ctx.world_size) if replicated else None
        ward = ward_of(ctx.rank, ranks_on_node, ctx.world_size) if replicated else None
        # collective: every rank builds its tier at the same point
        self.link = new_link(buddy, ward, timeout_s=self.wait_s)
        self.place = SnapshotPlace(self.store, ctx.world_size, ctx.rank, self.link, self.keep_last)
        self.stager = SharedStager()
        self.job: SnapshotJob | None = None
        self.jobs = JobThread()
        self._stall: StallFields | None = None
        self._sections: set[str] = set()
        self._copy_wait: float | None = None  # what the update after a snapshot waited for its copies
        self.meter = CostMeter()
        self.schedule: SnapshotSchedule | None = None  # made at the attempt's first step (``start``)

    def start(self, step: int) -> None:
        """The attempt trains from ``step`` on: its snapshot schedule (``auto``: the MTBF, with the
        failures rank 0's ledger has seen)."""
        c = self.cfg.checkpoint
        every = c.memory.every_steps
        failures, trained_s = 0, 0.0
        if every == "auto" and self.ctx.is_main:
            failures, trained_s = ledger_failures(
                read_events(self.paths).events, current_attempt=self.attempt
            )
        mtbf = run_mtbf_s(c.mtbf_hours, self.cfg.scheduler.nodes, failures=failures, trained_s=trained_s)
        self.schedule = SnapshotSchedule(
            None if every == "auto" else int(every or 1), mtbf_s=mtbf, start_step=step
        )

    # ---- while training -----------------------------------------------------------------------

    def after_step(
        self,
        step: int,
        state: Callable[[], State],
        *,
        disk_save_now: bool,
    ) -> None:
        """Every rank, after every step: settle a finished snapshot, start one when due. A snapshot
        still moving when the next is due is waited for, up to its deadline (every rank starts each
        due one, so every send has its receive); one that failed is said and dropped: the disk tier
        is still there. The loop's period from one call to the next is what the cost meter reads."""
        self.meter.period_ended(time.perf_counter())
        try:
            self._after_step(step, state, disk_save_now)
        finally:
            in_flight = self.job is not None and not self.job.done()
            self.meter.period_begins(time.perf_counter(), job_in_flight=in_flight)

    def _after_step(self, step: int, state: Callable[[], State], disk_save_now: bool) -> None:
        if self.schedule is None:
            self.start(step - 1)
        assert self.schedule is not None
        if self.job is not None and self.job.done():
            self._settle()
        if not self.schedule.due(step):
            return
        if disk_save_now:  # (the disk has this step)
            self.schedule.postpone(step)
            return
        begun = time.perf_counter()
        if self.job is not None and self.off is None and self._join():
            self._settle()
        joined = time.perf_counter()
        if self.schedule.auto:  # collective: every rank, its tier off or not
            self._decide(step)
        if self.off is not None:
            return
        waited = time.perf_counter()
        staged: Staged | None = None
        finish, failed = None, None
        try:
            if self.store is None:  # (said once: the job only tells the buddy and hears the ward)
                raise OSError("the memory tier has no place on this node")
            snapshot = state()
            built = time.perf_counter()
            staged, finish = self.stager.stage_later(snapshot)  # the copies: in the job (see before_update)
        except (OSError, RuntimeError) as e:
            # (a job all the same, with nothing of its own: its buddy and its ward wait for it)
            failed, built = f"staging the snapshot of step {step}: {e}", time.perf_counter()
        staged_at = time.perf_counter()
        self.meter.job_started()
        self.job = self.jobs.submit(
            SnapshotJob(
                self.place,
                staged=staged,
                finish=finish,
                describe=functools.partial(self._describe, step),
                step=step,
                error=failed,
            )
        )
        parts = {"wait": joined - begun, "state": built - waited, "layout": staged_at - built}
        if self.schedule.auto:
            parts["decide"] = waited - joined  # (auto: rank 0's decision, broadcast)
        self._stall = {
            "stall_s": round(time.perf_counter() - begun, 5),
            "stall_parts": {k: round(v, 5) for k, v in parts.items()},
            "bytes": staged.layout.nbytes if staged is not None else 0,
        }

    def _decide(self, step: int) -> None:
        """``auto``: rank 0 picks the next snapshot step from its measurements, every rank adopts it."""
        assert self.schedule is not None
        main = self.ctx.is_main
        decision: Mapping[str, Any] = self.schedule.propose(step, self.meter) if main else {}
        if self.ctx.initialized:
            decision = broadcast_json(decision, self.ctx.host_group(), is_source=main)
        self.schedule.adopt(decision)
        self._note(SNAPSHOT_INTERVAL, **decision)

    def _describe(self, step: int, staged: Staged, crc32: int) -> bytes:
        return shard.describe_bytes(
            staged,
            step=step,
            rank=self.ctx.rank,
            world_size=self.ctx.world_size,
            hashes=self.hashes,
            crc32=crc32,
        )

    def _join(self) -> bool:
        """Wait for the job in flight until ``wait_s`` after it began; False (said, and the tier
        off for the rest of the attempt) when it is still running then: a peer is gone or stuck,
        and waiting longer would stall training or a stop's save."""
        job = self.job
        assert job is not None
        if job.join(max(0.0, job.submitted + self.wait_s - time.monotonic())):
            return True
        self._step_aside(
            job.step,
            f"the snapshot of step {job.step} was still moving {self.wait_s:g} s after it began "
            "(checkpoint.memory.wait_s): its buddy or ward is gone or stuck",
        )
        return False

    def _step_aside(self, step: int, why: str) -> None:
        """The tier is off for the rest of the attempt (said once, whatever was said before)."""
        if self.off is None:
            self.off = why
            self._say(step, f"{why}; the memory tier is off for the rest of this attempt")

    def _settle(self) -> None:
        job, self.job = self.job, None
        assert job is not None
        if job.crash is not None:
            raise job.crash  # a bug, not a failed snapshot: the rank fails and says so
        if job.link_broken:  # (gloo's link is unusable after an error: every later one would fail)
            self.failures += 1
            self._step_aside(job.step, job.error or f"the snapshot of step {job.step}: its link broke")
        elif job.error is not None:
            self._fail(job.step, job.error)
        else:
            cost: dict[str, object] = dict(self._stall or {})
            cost["copy_wait_s"] = round(self._copy_wait or 0.0, 5)
            beside, whole = self.meter.job_settled(float(cost.get("stall_s") or 0.0))  # type: ignore[arg-type]
            cost["beside_s"], cost["whole_s"] = round(beside, 5), round(whole, 5)
            if job.replica_kept is not None:
                cost["replica"] = job.replica_kept
            self._note(SNAPSHOT_SAVED, step=job.step, seconds=round(job.seconds or 0.0, 4), **cost)
        self._copy_wait = None

    def _fail(self, step: int | None, error: str) -> None:
        """A snapshot that failed: the first of the attempt is said, the others counted."""
        self.failures += 1
        if self.failures == 1:
            self._say(step, error)

    def _say(self, step: int | None, error: str) -> None:
        """Once per rank and what: the ledger (this rank's own writer: another node's failure is
        seen by none of rank 0's jobs) and this rank's stderr, in the user's words."""
        words = f"{error}; training goes on, the disk tier serves"
        ledger = self.ledger or Ledger(self.paths, role="trainer", attempt=self.attempt)
        self.ledger = ledger
        ledger.append(SNAPSHOT_FAILED, step=step, error=words, rank=self.ctx.rank, node_name=self.node)
        print(f"hpclaunch: rank {self.ctx.rank} on {self.node}: {words}", file=sys.stderr, flush=True)

    def _note(self, event: str, **fields: Any) -> None:
        if self.ledger is not None and self.ctx.is_main:
            self.ledger.append(event, **fields)

    # ---- resume -------------------------------------------------------------------------------

    def restore(
        self, template: Callable[[], State], disk: Path, group: Any
    ) -> tuple[tuple[Restored, State] | None, TierFields]:
        """Collective: fill a ``template()`` from the newest whole snapshot newer than the newest
        checkpoint on ``disk``; ((what was restored, the state) or None, what the ledger's
        ``resumed`` says of the tiers). The template is made only when a snapshot is there to fill
        it: making an optimizer's state dict may run its first (zero-lr) step."""
        disk_step = _newest_step(disk) if self.ctx.is_main else None
        plan, on_disk = gather_plan(self.store, self.ctx, self.node, disk_step, group)
        tier: TierFields = {"disk_step": on_disk}
        if self.ctx.local_rank == 0 and self.store is not None:
            # (before any rank of this node writes again: their first steps need this rank)
            with contextlib.suppress(OSError):
                self.store.forget_after(plan.step)
        if plan.step is None:
            return None, {**tier, "memory_reason": plan.reason}
        state = template()
        expect = {"step": plan.step, "rank": self.ctx.rank, "world_size": self.ctx.world_size, **self.hashes}
        filled = fill_from_plan(state, plan, self.store, self.ctx, expect, group)
        why = filled if isinstance(filled, str) else None
        if why is not None:
            if self.ctx.local_rank == 0 and self.store is not None:
                with contextlib.suppress(OSError):  # (the disk serves: a new timeline from its step)
                    self.store.forget_after(None)
            return None, {**tier, "memory_reason": why}
        assert not isinstance(filled, str)
        self._sections = filled
        path = str(self.store.step_dir(plan.step, self.ctx.world_size)) if self.store else "pulled"
        return (Restored(plan.step, self._sections, path), state), {
            **tier,
            "tier": "memory",
            "shards_from": plan.shards_from(),
        }

    # ---- end ----------------------------------------------------------------------------------

    def drop_pending(self) -> None:
        """Every rank, before a stop's or the end's save to disk: the snapshot still moving finishes
        (its peer is alive and waits for it), up to its deadline, and is said."""
        if self.job is not None and self._join():
            self._settle()

    def close(self, *, remove: bool) -> None:
        """Let the snapshot in flight end; ``remove``: the last save is on disk, so this node's
        memory of this run's snapshots is freed (by the node's first rank). A job the tier stepped
        aside from still ends by itself (each of its waits on a peer ends at gloo's timeout,
        ``wait_s``): it is given until ``DRAIN_WAITS`` of them have passed, so that no rank tears the
        link down while a peer's job still talks on it (that aborts the process; the trainer's
        collectives after this call keep every rank here until all have). A job that has not ended
        even then keeps its staging buffer (freed when the process exits): closing it under the job
        would let it copy from whatever reuses the descriptor."""
        job, self.job = self.job, None
        ended = job is None or job.join(
            max(0.0, job.submitted + DRAIN_WAITS * self.wait_s - time.monotonic())
        )
        self.jobs.close()
        if ended:
            self.stager.close()
        if self.store is not None:
            self.store.close(remove=remove and ended and self.ctx.local_rank == 0)

    def before_update(self) -> None:
        """Before anything changes the live tensors (the optimizer, an evaluation's EMA swap): the
        snapshot's staging copies are done (on CPU the job copies while forward and backward run; on
        CUDA the GPU waits, not the host). Called after every step's backward, applied or not."""
        if self.job is not None and self.job.staged is not None:
            started = time.perf_counter()
            self.job.staged.copied.wait()
            if self._copy_wait is None:
                self._copy_wait = time.perf_counter() - started
        self.stager.before_update()


def _newest_step(directory: Path) -> int | None:
    """The newest complete checkpoint's step in ``directory`` by its structure, or None (also when
    the directory cannot be read: the tier that cannot be read is not chosen)."""
    try:
        info, _ = newest_valid(directory, verify_hashes=False)
    except (OSError, CheckpointError, FilesystemError):
        return None
    return info.step if info is not None else None
