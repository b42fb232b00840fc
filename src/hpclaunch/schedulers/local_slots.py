"""A sweep's points on the local scheduler take turns: at most ``scheduler.array_parallelism`` of
them run at once, in the order of the sweep (as ``--array=0-N%P`` on SLURM, ``-J 0-N%P`` on PBS).

Each point has its own controller. One that may not start yet says so in its state file
(``held``, ``slot: true``) and waits; it starts when fewer than P of its sweep's other points run and
no point before it is still waiting for a slot, so two waiting points never take the same slot.
What the others do is read from their own state files (a controller that died holds no slot).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..rundir import RunPaths
from ..rundir.readers import sweep_roots

RUNNING = ("running", "cancelling", "requeued")

StateOf = Callable[[Path], dict[str, Any]]  # a point's run directory -> its controller's state


def sweep_points(run_dir: Path) -> list[Path]:
    """Every point of the sweep ``run_dir`` is a point of, in order ([] when it is none)."""
    points = [Path(p).resolve() for p in sweep_roots(RunPaths(run_dir.resolve().parent))]
    return points if run_dir.resolve() in points else []


def may_start(run_dir: Path, parallelism: int, state_of: StateOf, alive: Callable[[int], bool]) -> bool:
    points = sweep_points(run_dir)
    if not points:
        return True
    me = points.index(run_dir.resolve())
    running = 0
    for index, point in enumerate(points):
        if index == me:
            continue
        state = state_of(point)
        if not alive(int(state.get("pid", 0) or 0)):
            continue
        if state.get("state") in RUNNING:
            running += 1
        elif index < me and state.get("state") == "held" and state.get("slot"):
            return False  # an earlier point waits for the same slot: it goes first
    return running < parallelism
