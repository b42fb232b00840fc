"""The memory tier: snapshots of the training state in the nodes' shared memory, between the
checkpoints on disk, each rank's shard also on a peer node, so that a crash, a hang or a node's
death restarted in place loses seconds, not an interval.

Every ``checkpoint.memory.every_steps`` steps each rank stages its state (the staging copy: the
stall) and a thread of the rank writes it into its node's tmpfs (``/dev/shm/hpclaunch/<run id>/<node>``
unless ``checkpoint.memory.dir`` says otherwise) and sends it to its buddy on the next node, which
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
import hashlib
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple, TypedDict

from ..config import RunConfig
from ..errors import CheckpointError, FilesystemError
from ..rundir import SNAPSHOT_FAILED, SNAPSHOT_SAVED, Ledger, RunPaths
from ..rundir.env import ALLOCATION_VAR, NODE_NAME_VAR
from .checkpoint.manifest import newest_valid
from .checkpoint.staging import SharedStager, Staged
from .dist import DistContext, all_gather_json
from .snapshots import shard
from .snapshots.plan import RestorePlan, buddy_of, plan_restore, ward_of
from .snapshots.shard import State
from .snapshots.store import NodeStore, describe_json
from .snapshots.transfer import JobThread, SnapshotJob, exchange_pulls, new_link

SHM_ROOT = Path("/dev/shm/hpclaunch")


def snapshot_dir(cfg: RunConfig, paths: RunPaths) -> Path:
    """Where this run's snapshots live: one directory per run directory, one below it per node."""
    if cfg.checkpoint.memory.dir:
        return Path(cfg.checkpoint.memory.dir)
    run_id = hashlib.sha256(str(paths.root.resolve()).encode()).hexdigest()[:16]
    return SHM_ROOT / run_id


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
    """One rank's memory tier: when to snapshot, its node's store, its buddy, what they cost."""

    def __init__(
        self, cfg: RunConfig, ctx: DistContext, paths: RunPaths, ledger: Ledger | None, *, ranks_on_node: int
    ) -> None:
        m = cfg.checkpoint.memory
        assert m.every_steps is not None
        self.every, self.keep_last = m.every_steps, m.keep_last
        self.ctx = ctx
        self.ledger = ledger
        self.root = snapshot_dir(cfg, paths)
        self.store = NodeStore(self.root, node_name(), os.environ.get(ALLOCATION_VAR))
        if ctx.local_rank == 0:  # (memory does not outlive an allocation: a new one uses the disk)
            self.store.forget_other_allocations()
        self.hashes = {"config_hash": cfg.config_hash(), "model_hash": cfg.model_hash()}
        replicated = m.replicas > 0
        buddy = buddy_of(ctx.rank, ranks_on_node, ctx.world_size) if replicated else None
        ward = ward_of(ctx.rank, ranks_on_node, ctx.world_size) if replicated else None
        self.link = new_link(buddy, ward)  # collective: every rank builds its tier at the same point
        self.stager = SharedStager()
        self.job: SnapshotJob | None = None
        self.jobs = JobThread()
        self._stall: StallFields | None = None
        self._sections: set[str] = set()
        self._copy_wait: float | None = None  # what the update after a snapshot waited for its copies

    # ---- while training -----------------------------------------------------------------------

    def after_step(
        self,
        step: int,
        state: Callable[[], State],
        *,
        disk_save_now: bool,
    ) -> None:
        """Every rank, after every step: settle a finished snapshot, start one when due. A snapshot
        still moving when the next is due is waited for (every rank starts each due one, so every
        send has its receive); one that failed is said and dropped: the disk tier is still there."""
        if self.job is not None and self.job.done():
            self._settle()
        if step % self.every or disk_save_now:
            return
        begun = time.perf_counter()
        if self.job is not None:
            self.job.join()
            self._settle()
        waited = time.perf_counter()
        staged: Staged | None = None
        finish, failed = None, None
        try:
            snapshot = state()
            built = time.perf_counter()
            staged, finish = self.stager.stage_later(snapshot)  # the copies: in the job (see before_update)
        except (OSError, RuntimeError) as e:
            # (a job all the same, with nothing of its own: its buddy and its ward wait for it)
            failed, built = f"staging the snapshot of step {step}: {e}", time.perf_counter()
        staged_at = time.perf_counter()
        self.job = self.jobs.submit(
            SnapshotJob(
                self.store,
                staged=staged,
                finish=finish,
                describe=functools.partial(self._describe, step),
                step=step,
                world=self.ctx.world_size,
                rank=self.ctx.rank,
                link=self.link,
                keep_last=self.keep_last,
                error=failed,
            )
        )
        parts = {"wait": waited - begun, "state": built - waited, "layout": staged_at - built}
        self._stall = {
            "stall_s": round(time.perf_counter() - begun, 5),
            "stall_parts": {k: round(v, 5) for k, v in parts.items()},
            "bytes": staged.layout.nbytes if staged is not None else 0,
        }

    def _describe(self, step: int, staged: Staged) -> bytes:
        meta = shard.describe(
            staged, step=step, rank=self.ctx.rank, world_size=self.ctx.world_size, hashes=self.hashes
        )
        return describe_json(meta)

    def _settle(self) -> None:
        job, self.job = self.job, None
        assert job is not None
        if job.error is not None:
            self._note(SNAPSHOT_FAILED, step=job.step, error=job.error)
        else:
            cost: dict[str, object] = dict(self._stall or {})
            cost["copy_wait_s"] = round(self._copy_wait or 0.0, 5)
            self._note(SNAPSHOT_SAVED, step=job.step, seconds=round(job.seconds or 0.0, 4), **cost)
        self._copy_wait = None

    def _note(self, event: str, **fields: Any) -> None:
        if self.ledger is not None:
            self.ledger.append(event, **fields)

    # ---- resume -------------------------------------------------------------------------------

    def restore(self, state: State, disk: Path, group: Any) -> tuple[Restored | None, TierFields]:
        """Collective: fill ``state`` from the newest whole snapshot newer than the newest checkpoint
        on ``disk``; (what was restored or None, what the ledger's ``resumed`` says of the tiers)."""
        report = {
            "node": self.store.node,
            "disk": _newest_step(disk) if self.ctx.is_main else None,
            # (one rank per node says what the node holds: the others would repeat it)
            "holds": [
                [s, w, r, n, m]
                for s, worlds in (self.store.holdings() if self.ctx.local_rank == 0 else {}).items()
                for w, ranks in worlds.items()
                for r, (n, m) in ranks.items()
            ],
        }
        reports = all_gather_json(report, group)
        on_disk: int | None = reports[0]["disk"]
        hosts = [r["node"] for r in reports]
        holdings: dict[str, dict[int, dict[int, dict[int, tuple[int, int]]]]] = {}
        for r in reports:
            held = holdings.setdefault(r["node"], {})
            for s, w, rank, n, m in r["holds"]:
                held.setdefault(s, {}).setdefault(w, {})[rank] = (n, m)
        plan = plan_restore(hosts, holdings, on_disk)
        tier: TierFields = {"disk_step": on_disk}
        if plan.step is None:
            return None, {**tier, "memory_reason": plan.reason}
        why = self._fill(state, plan, group)
        if why is not None:
            return None, {**tier, "memory_reason": why}
        sections = self._sections
        path = str(self.store.step_dir(plan.step, self.ctx.world_size))
        return Restored(plan.step, sections, path), {
            **tier,
            "tier": "memory",
            "shards_from": plan.shards_from(),
        }

    def _fill(self, state: State, plan: RestorePlan, group: Any) -> str | None:
        """Collective: this rank's shard (read here, or pulled), checked on every rank, then copied;
        the reason when any rank's does not fit (nothing is copied then, on any rank)."""
        assert plan.step is not None
        pulled = exchange_pulls(plan.pulls, self.store, plan.step, self.ctx.world_size, self.ctx.rank, group)
        why: str | None = None
        meta: shard.ShardMeta | None = None
        payload = b""
        try:
            if pulled is None:
                meta_bytes, payload = self.store.read(plan.step, self.ctx.world_size, self.ctx.rank)
            else:
                meta_bytes, payload = pulled
            meta = shard.parse(meta_bytes)
            expect = {
                "step": plan.step,
                "rank": self.ctx.rank,
                "world_size": self.ctx.world_size,
                **self.hashes,
            }
            why = shard.misfit(state, meta, expect)
        except (OSError, ValueError) as e:
            why = f"rank {self.ctx.rank}'s snapshot cannot be read: {e}"
        whys = all_gather_json(why, group)
        first = next((w for w in whys if w is not None), None)
        if first is not None:
            return first
        assert meta is not None
        self._sections = shard.fill(state, meta, payload)
        return None

    # ---- end ----------------------------------------------------------------------------------

    def drop_pending(self) -> None:
        """Every rank, before a stop's or the end's save to disk: the snapshot still moving finishes
        (its peer is alive and waits for it), and is said."""
        if self.job is not None:
            self.job.join()
            self._settle()

    def close(self, *, remove: bool) -> None:
        """Let the snapshot in flight finish for a moment; ``remove``: the last save is on disk, so
        this node's memory of this run's snapshots is freed (by the node's first rank)."""
        if self.job is not None:
            self.job.join(timeout=30)
            self.job = None
        self.jobs.close()
        self.stager.close()
        if remove and self.ctx.local_rank == 0:  # (every job of the node has ended: see the stop)
            self.store.remove()
            with contextlib.suppress(OSError):
                self.root.rmdir()  # the last node out (where nodes share a /dev/shm)

    def before_update(self) -> None:
        """Before the optimizer changes the live tensors: the snapshot's staging copies are done (on
        CPU the job copies while forward and backward run; on CUDA the GPU waits, not the host)."""
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
