"""A run's saves between its steps, both tiers at once: the checkpoints on disk (periodic, in the
background; a stop's and the last, blocking) and the memory tier's snapshots.

``Run`` says when (after a step, when the ranks agreed to stop, at the end); this says what happens
to each tier then, in the order that keeps them consistent: a snapshot never outlives the disk
save that supersedes it, and the node's memory is freed only once the last save is on disk.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from .checkpoint import Checkpointer
from .memory_tier import MemoryTier
from .periodic_saves import PeriodicSaves
from .saving import DiskSaves

__all__ = ["StateSaves"]


class StateSaves:
    """One rank's two tiers (either may be absent: a run without checkpoints, no memory tier)."""

    def __init__(
        self, checkpointer: Checkpointer | None, memory: MemoryTier | None, disk: DiskSaves | None
    ) -> None:
        self.checkpointer = checkpointer
        self.memory = memory
        self.disk = disk
        self.periodic: PeriodicSaves | None = None

    def begin(self, periodic: PeriodicSaves | None, step: int) -> None:
        """The loop starts after ``step``: the disk's save interval, the memory tier's first snapshot."""
        self.periodic = periodic if self.checkpointer is not None else None
        if self.memory is not None:
            self.memory.start(step)

    def after_step(self, step: int, seconds: float, group: dist.ProcessGroup | None) -> None:
        """A step ended: its time measured, a failed background save saved again, a settled one timed."""
        periodic, disk = self.periodic, self.disk
        if periodic is not None and disk is not None:
            periodic.observe(seconds, self.checkpointer)
            disk.act_on_failed_background_save(group)
            periodic.after_step(self.checkpointer, step)

    def when_due(self, step: int, snapshot_state: Callable[[], dict[str, Any]]) -> None:
        """After the stop check let the run go on: a background save and a snapshot, each if due."""
        periodic, disk = self.periodic, self.disk
        disk_now = periodic is not None and periodic.due(step)
        if disk_now and disk is not None and periodic is not None:
            disk.save(blocking=False)
            periodic.started(self.checkpointer, step)
        if self.memory is not None:
            self.memory.after_step(step, snapshot_state, disk_save_now=disk_now)

    def last_save(self, *, stopping: bool) -> None:
        """The attempt's last save, blocking (a stop's supersedes a background save still writing);
        then the node's memory is freed: the disk has everything."""
        if self.memory is not None:
            self.memory.drop_pending()
        if self.disk is not None:
            self.disk.save(blocking=True, supersede=stopping)
        if self.checkpointer is not None:
            self.checkpointer.wait()
        if self.memory is not None:
            self.memory.close(remove=True)
            self.memory = None

    def save_now(self) -> None:
        if self.disk is not None:
            self.disk.save(blocking=True)

    def before_update(self) -> None:
        """Before the live tensors change: the staging copies of a save or snapshot just begun are done."""
        if self.checkpointer is not None:
            self.checkpointer.before_update()
        if self.memory is not None:
            self.memory.before_update()

    def close(self) -> None:
        """Writers and threads go; the memory tier keeps its snapshots for an in-place restart."""
        if self.memory is not None:
            self.memory.close(remove=False)
        if self.checkpointer is not None:
            self.checkpointer.close()
