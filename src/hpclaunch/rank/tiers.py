"""The two state tiers of a rank's run, made from the run's config: the checkpoints on disk
(``checkpoint``) and, where ``checkpoint.memory.every_steps`` is set and the rank runs under
hpclaunch, the snapshots in the nodes' memory (``memory_tier``)."""

from __future__ import annotations

import os

from ..config import RunConfig
from ..rundir import Ledger, RunPaths
from .checkpoint import Checkpointer, RunCheckpoints, WriterSettings
from .checkpoint.writing import resolve_write_threads
from .dist import DistContext
from .memory_tier import MemoryTier

__all__ = ["Hashes", "make_checkpointer", "make_memory_tier", "ranks_on_node"]

Hashes = dict[str, str]  # config_hash, model_hash


def ranks_on_node(cfg: RunConfig) -> int:
    """This node's ranks: what the launcher said where it started us, else the config's."""
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    return int(local) if local.isdigit() else max(1, cfg.scheduler.nprocs)


def make_checkpointer(
    cfg: RunConfig, ctx: DistContext, paths: RunPaths, ledger: Ledger | None, hashes: Hashes
) -> Checkpointer:
    c = cfg.checkpoint
    checkpoints = RunCheckpoints(
        paths.checkpoints,
        world_size=ctx.world_size,
        config_hash=hashes["config_hash"],
        model_hash=hashes["model_hash"],
        keep_last=c.keep_last,
        keep_every=c.keep_every,
        # the built-in trainer's checkpoints written before its model hash left flash_attn out
        model_hashes_before=() if cfg.is_script else cfg.model_hashes_accepted()[1:],
    )
    writing = WriterSettings(
        async_save=c.async_save,
        writer=c.writer,
        nice=c.writer_nice,
        idle=c.writer_idle,
        write_threads=resolve_write_threads(c.write_threads, ranks_on_node(cfg)),
    )
    return Checkpointer(checkpoints, rank=ctx.rank, writing=writing, ledger=ledger)


def make_memory_tier(
    cfg: RunConfig, ctx: DistContext, paths: RunPaths, ledger: Ledger | None, hashes: Hashes
) -> MemoryTier | None:
    """The memory tier's snapshots (``checkpoint.memory``), or None when it is off."""
    if cfg.checkpoint.memory.every_steps is None:
        return None
    return MemoryTier(cfg, ctx, paths, ledger, ranks_on_node=ranks_on_node(cfg), hashes=hashes)
