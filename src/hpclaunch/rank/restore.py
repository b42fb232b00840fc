"""The one restore rule, for a first run, a requeue and an in-place restart alike: the newest whole
snapshot in the allocation's memory when it is newer than the disk's newest checkpoint, else the
newest valid checkpoint on disk (at any world size), else nothing (a fresh start). A rank's objects
then take what was loaded (``objects.Attached.take``), and rank 0 records ``resumed``: where from,
how long start-up took, and what the tiers said.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..rundir import RESUMED, Ledger, RunPaths
from ..rundir.paths import newest_checkpoint_step
from .checkpoint import Checkpointer
from .dist import DistContext, broadcast_json
from .memory_tier import MemoryTier, TierFields
from .objects import Attached
from .startup import StartupClock

__all__ = ["Restored", "record_resumed", "restore"]


@dataclass
class Restored:
    """Where a rank's state came from."""

    step: int = 0
    checkpoint: str | None = None  # the checkpoint's or snapshot's path; None: a fresh start
    tier: TierFields = field(
        default_factory=lambda: TierFields()
    )  # (with the memory tier: which one, and the disk's step)
    counters: dict[str, int] = field(default_factory=dict)  # the run's own, as saved

    @property
    def source(self) -> str | None:
        """``memory``, ``disk`` or None (nothing restored)."""
        if self.checkpoint is None:
            return None
        return str(self.tier.get("tier") or "disk")


def restore(
    attached: Attached,
    *,
    ctx: DistContext,
    paths: RunPaths,
    checkpointer: Checkpointer | None,
    memory: MemoryTier | None,
) -> Restored:
    """Collective: load the newest state into ``attached``'s objects (see the module docstring)."""
    if checkpointer is None:
        return Restored()
    empty = {"step": 0}
    tier: TierFields = {}
    state: dict[str, Any] | None = None
    loaded: Any = None
    path: str | None = None
    if memory is not None:
        found, tier = memory.restore(lambda: attached.state(empty), checkpointer.directory, ctx.host_group())
        if found is not None:
            loaded, state = found
            path = loaded.path
    if loaded is None and _disk_has_one(paths, ctx):
        # (the template is made only now: an optimizer's state dict may run its zero-lr first step,
        # which a run that restores nothing must not)
        state = attached.state(empty)
        result = checkpointer.load_latest(state)
        if result is not None:
            loaded, path = result, str(result.info.path)
    if loaded is None or state is None:
        return Restored(tier=tier)
    counters = attached.take(state, loaded)
    if memory is not None:
        tier.setdefault("tier", "disk")
    return Restored(step=int(counters.get("step", 0)), checkpoint=path, tier=tier, counters=counters)


def _disk_has_one(paths: RunPaths, ctx: DistContext) -> bool:
    """Rank 0 looks (one listing), every rank hears: a published checkpoint exists."""
    mine = newest_checkpoint_step(paths) is not None if ctx.is_main else None
    return bool(broadcast_json(mine, ctx.host_group(), is_source=ctx.is_main))


def record_resumed(
    ledger: Ledger,
    restored: Restored,
    ctx: DistContext,
    *,
    startup: StartupClock,
    total: int | None,
    **fields: Any,
) -> None:
    """Rank 0's ``resumed`` event (``startup``: its contract with goodput accounting)."""
    ledger.append(
        RESUMED,
        step=restored.step,
        checkpoint=restored.checkpoint,
        world_size=ctx.world_size,
        total_steps=total,
        process_start=round(startup.process_start, 3),
        startup_s=startup.seconds(),
        **fields,
        **restored.tier,
    )
