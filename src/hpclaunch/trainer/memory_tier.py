"""The memory tier: snapshots of the training state in the node's shared memory, between the
checkpoints on disk, so that a crash or a hang restarted in place loses seconds, not an interval.

Every ``checkpoint.memory.every_steps`` steps each rank's state goes the way of a background disk
save: staged in one copy (the stall), written by the rank's writer process into a directory on a
tmpfs (``/dev/shm/hpclaunch/<run id>`` unless ``checkpoint.memory.dir`` says otherwise), published
by rename once every rank's files and the manifest are there. So a snapshot is complete or it does
not exist: a rank killed while writing leaves a temporary directory that no resume reads.

After an in-place restart, ``Trainer.resume`` asks ``choose_tier``: the newest complete snapshot if
it is newer than the newest checkpoint on disk, else the disk. The ledger's ``resumed`` says which
tier and the disk's step beside it (what the memory tier saved). A snapshot never replaces a disk
save: the stop's save (preemption, the time limit, a user stop) and the periodic ones still go to
disk, and memory does not outlive the allocation: the directory is removed when the trainer ends
with its last save on disk.

One node for now (config refuses more): every rank of the run writes into the same tmpfs, so a
snapshot is a whole DCP checkpoint. Several nodes need each node's shards copied to a peer node
(docs/design.md, "next").
"""

from __future__ import annotations

import hashlib
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..config import RunConfig
from ..errors import CheckpointError, FilesystemError
from ..rundir import SNAPSHOT_FAILED, SNAPSHOT_SAVED, Ledger, RunPaths
from .checkpoint import Checkpointer
from .checkpoint.manifest import newest_valid
from .checkpoint.writing import resolve_write_threads
from .dist import DistContext, broadcast_json

SHM_ROOT = Path("/dev/shm/hpclaunch")


def snapshot_dir(cfg: RunConfig, paths: RunPaths) -> Path:
    """Where this run's snapshots live on the node: one directory per run directory."""
    if cfg.checkpoint.memory.dir:
        return Path(cfg.checkpoint.memory.dir)
    run_id = hashlib.sha256(str(paths.root.resolve()).encode()).hexdigest()[:16]
    return SHM_ROOT / run_id


class MemoryTier:
    """One rank's memory tier: when to snapshot, the snapshots' checkpointer, and what they cost."""

    def __init__(
        self,
        cfg: RunConfig,
        ctx: DistContext,
        paths: RunPaths,
        ledger: Ledger | None,
        *,
        ranks_on_node: int,
    ) -> None:
        m = cfg.checkpoint.memory
        assert m.every_steps is not None
        self.every = m.every_steps
        self.ctx = ctx
        self.ledger = ledger
        self.directory = snapshot_dir(cfg, paths)
        # No ledger of its own: its saves are snapshots (``snapshot_saved``), not checkpoints, and
        # must not count where checkpoints do (status, the save interval, goodput).
        self.checkpointer = Checkpointer(
            self.directory,
            rank=ctx.rank,
            world_size=ctx.world_size,
            config_hash=cfg.config_hash(),
            model_hash=cfg.model_hash(),
            keep_last=m.keep_last,
            writer="process",
            writer_nice=cfg.checkpoint.writer_nice,
            # Never at idle priority: nothing ever waits for a snapshot, so where every core trains
            # an idle writer would never be found starved and replaced; it would simply never finish.
            writer_idle=False,
            write_threads=resolve_write_threads(cfg.checkpoint.write_threads, ranks_on_node),
        )
        # Its writers start now: the first snapshot would otherwise wait for a torch import.
        self.checkpointer.prestart_writer()
        self._settled = 0
        self._step: int | None = None  # the snapshot in flight, what it stalled and where
        self._stall: float | None = None
        self._stall_parts: dict[str, float] | None = None

    # ---- while training -----------------------------------------------------------------------

    def after_step(
        self,
        step: int,
        state: Callable[[], dict[str, Any]],
        extra: Callable[[], dict[str, Any]],
        group: Any,
        *,
        disk_save_now: bool,
    ) -> None:
        """Every rank, after every step: settle a finished snapshot, start one when due. A snapshot
        still writing is never waited for (the next due step is skipped instead), and one that
        failed is said and dropped: the disk tier is still there."""
        ck = self.checkpointer
        error = ck.poll_background(group)  # collective only while one is pending (alike on all ranks)
        if error is not None:
            self._note(SNAPSHOT_FAILED, step=self._step, error=error.one_line())
            self._step = None
        elif ck.settled_saves != self._settled:
            self._settled = ck.settled_saves
            self._note(
                SNAPSHOT_SAVED,
                step=self._step,
                seconds=ck.last_save_seconds,
                stall_s=self._stall,
                stall_parts=self._stall_parts,
            )
            self._step = None
        if step % self.every or disk_save_now or ck.pending:
            return
        begun = time.perf_counter()
        try:
            snapshot = state()
            built = time.perf_counter()
            ck.save(step, snapshot, blocking=False, extra=extra())
        except CheckpointError as e:  # (staging itself failed: no writer was started)
            self._note(SNAPSHOT_FAILED, step=step, error=e.one_line())
            return
        self._step, self._stall = step, time.perf_counter() - begun
        # where the stall went: the state dict, then the checkpointer's own parts
        parts = {"state": built - begun, **ck.last_stall_parts}
        self._stall_parts = {k: round(v, 5) for k, v in parts.items()}

    def _note(self, event: str, **fields: Any) -> None:
        if self.ledger is not None:
            self.ledger.append(event, **fields)

    # ---- resume -------------------------------------------------------------------------------

    def newest_steps(self, disk: Path, group: Any) -> tuple[int | None, int | None]:
        """Collective: (the newest checkpoint's step on ``disk``, the newest complete snapshot's), each
        None where there is none. Rank 0 looks at both, by structure and sizes (every rank checks
        its share of the hashes when it loads), and tells every rank in one broadcast."""
        steps: list[int | None] = [None, None]
        if self.ctx.is_main:
            steps = [_newest_step(disk), _newest_step(self.directory)]
        on_disk, in_memory = broadcast_json(steps, group, is_source=self.ctx.is_main)
        return on_disk, in_memory

    # ---- end ----------------------------------------------------------------------------------

    def drop_pending(self) -> None:
        """Every rank, before a stop's or the end's save to disk: a snapshot still writing is
        dropped (the disk save is newer) so that its writer takes no CPU from that save."""
        try:
            self.checkpointer.wait(supersede=True)
        except CheckpointError as e:
            self._note(SNAPSHOT_FAILED, step=self._step, error=e.one_line())
        self._step = None

    def close(self, *, remove: bool) -> None:
        """Stop the writer (a snapshot still writing is dropped); ``remove``: the last save is on
        disk, so rank 0 frees the node's memory of this run's snapshots."""
        self.checkpointer.close()
        if remove and self.ctx.is_main:
            shutil.rmtree(self.directory, ignore_errors=True)


def _newest_step(directory: Path) -> int | None:
    """The newest complete checkpoint's step in ``directory`` by its structure, or None (also when
    the directory cannot be read: the tier that cannot be read is not chosen)."""
    try:
        info, _ = newest_valid(directory, verify_hashes=False)
    except (OSError, CheckpointError, FilesystemError):
        return None
    return info.step if info is not None else None
