"""The node agent's part in the memory tier (``checkpoint.memory``; the place: ``rundir.shm``): the
snapshots in a node's tmpfs are its RAM, and they do not outlive the run's stay on the node.

The agent lives for the whole allocation on its node, whatever its ranks do (crash, SIGKILL, a
failed run), so it is the one that frees: at its start it sweeps what ended allocations of this
user left on the node; while its node trains it holds this allocation's directory (so that a sweep
by another of the user's runs leaves it alone between two attempts in place); and it frees it
whenever the run does not restart in place on the node: a decision through the scheduler
(requeue, continuation, failed, finished), its node left out of the next roster, its own end.
An agent killed before it could free is the next sweep's to clean up.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from ..config import MemoryTierConfig
from ..rundir import RunPaths
from ..rundir.shm import Hold, TierPlaceError, allocation_dir, base_of, run_root, sweep


class NodeMemory:
    """This node's snapshots of one allocation of the run (nothing when the tier is off)."""

    def __init__(self, memory: MemoryTierConfig, paths: RunPaths, node: str, allocation: str) -> None:
        self.on = memory.every_steps is not None
        self.base = base_of(memory)
        self.directory: Path = allocation_dir(run_root(memory, paths), node, allocation)
        self._hold: Hold | None = None

    def start(self) -> list[Path]:
        """At the agent's start: what ended allocations of this user left here, freed; the
        directories removed. (A tier without a place here is said by the ranks, not here.)"""
        if not self.on:
            return []
        with contextlib.suppress(OSError, TierPlaceError):
            return sweep(self.base)
        return []

    def hold(self) -> None:
        """Before an attempt on this node: keep the allocation's snapshots between attempts."""
        if self.on and self._hold is None:
            with contextlib.suppress(OSError, TierPlaceError):
                self._hold = Hold(self.directory, self.base)

    def free(self) -> None:
        """The run does not restart in place on this node: its snapshots here are freed."""
        if not self.on:
            return
        if self._hold is None and os.path.lexists(self.directory):
            self.hold()  # (only through a hold: its directories are checked to be this user's own)
        if self._hold is not None:
            self._hold.free()
            self._hold = None
