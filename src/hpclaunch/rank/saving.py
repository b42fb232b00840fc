"""A run's saves to disk: a checkpoint of the state after the current step, and what is done when a
background save failed.

A save first waits for the previous background save (should it have failed unseen), refuses
parameters that are not finite, and tells the stop controller how long it took (the deadline keeps
room for the next one). A background save that failed is saved again at once, blocking, and the
ledger says so (``checkpoint_failed``); a second failure stops the run with the reason.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import CheckpointError, TrainingError
from ..rundir import CHECKPOINT_FAILED, Ledger, RunPaths, read_events
from ..rundir.events import CheckpointSaved, of_kind
from .checkpoint import Checkpointer
from .dist import DistContext, broadcast_json
from .progress import Progress
from .stop import StopController

__all__ = ["DiskSaves", "seed_stop_lead"]

RECENT_SAVES = 8  # the run's newest saves among which the blocking ones seed an attempt's stop lead


def seed_stop_lead(stop: StopController, ctx: DistContext, paths: RunPaths | None) -> None:
    """The stop lead starts from the slowest of the run's recent blocking saves (an attempt too
    short to save before its stop would otherwise keep the plan's estimate for ever): the rank that
    reads the ledger (``paths`` given: rank 0 under hpclaunch) reads it, every rank hears (none
    found: the plan's estimate). A stop's save is blocking; a background save's time is its
    writer's, starved of CPU or not."""
    seconds = None
    if paths is not None:
        recent = of_kind(read_events(paths).events, CheckpointSaved)[-RECENT_SAVES:]
        measured = [e.seconds for e in recent if e.seconds is not None and e.blocking]
        seconds = max(measured) if measured else None
    if ctx.initialized:
        seconds = broadcast_json(seconds, ctx.host_group(), is_source=ctx.is_main)
    if seconds is not None:
        stop.note_checkpoint_seconds(float(seconds))


@dataclass(frozen=True)
class SavedState:
    """What a save writes, read when it is taken: the state dict, the step it follows, whether the
    parameters are finite, and the manifest's extra fields."""

    state: Callable[[], dict[str, Any]]
    step: Callable[[], int]
    finite: Callable[[], bool]
    extra: Callable[[], dict[str, Any]]


class DiskSaves:
    """One rank's saves through its checkpointer (every call collective)."""

    def __init__(
        self,
        checkpointer: Checkpointer,
        saved: SavedState,
        *,
        stop: StopController,
        progress: Progress,
        ledger: Ledger | None,
        say: Callable[[str], None],
    ) -> None:
        self.checkpointer = checkpointer
        self.state, self.step, self.finite, self.extra = saved.state, saved.step, saved.finite, saved.extra
        self.stop, self.progress, self.ledger, self.say = stop, progress, ledger, say

    def save(self, *, blocking: bool, supersede: bool = False) -> None:
        """Checkpoint the state after the current step (collective). ``supersede``: a stop's save;
        a background save still writing is dropped rather than waited for (this step is newer, and
        the deadline keeps no room for a writer starved of CPU or still starting)."""
        checkpointer = self.checkpointer
        # Waiting for the previous background save (should it have failed unseen) is save time: the
        # watchdog's long window, not a step's (a writer starved of CPU on a loaded node is no hang).
        self.progress.phase("save")
        try:
            checkpointer.wait(supersede=supersede)
        except CheckpointError as error:
            return self._save_again_after(error)
        if not self.finite():
            raise TrainingError(
                f"parameters are not finite after step {self.step()}; refusing to checkpoint them"
            )
        t0 = time.perf_counter()
        checkpointer.save(self.step(), self.state(), blocking=blocking, extra=self.extra())
        if blocking:
            self.stop.note_checkpoint_seconds(time.perf_counter() - t0)
        elif checkpointer.last_save_seconds is not None:
            self.stop.note_checkpoint_seconds(checkpointer.last_save_seconds)

    def act_on_failed_background_save(self, group: Any) -> None:
        """A background save that failed is saved again now, blocking; if that fails too, the run
        stops with the reason (collective while a background save is pending). One that settled
        is a measured save for the deadline's lead from this step on: without it an attempt whose
        only save so far ran in the background stops with the plan's estimate, which a loaded
        machine outruns (the PBS walltime test saved 0.3 s past the walltime that way)."""
        checkpointer = self.checkpointer
        settled = checkpointer.settled_saves
        error = checkpointer.poll_background(group)
        if error is not None:
            self._save_again_after(error)
        elif checkpointer.settled_saves != settled and checkpointer.last_save_seconds is not None:
            self.stop.note_checkpoint_seconds(checkpointer.last_save_seconds)

    def _save_again_after(self, error: CheckpointError) -> None:
        step = self.step()
        if self.ledger is not None:
            self.ledger.append(CHECKPOINT_FAILED, step=step, error=error.one_line(), action="blocking retry")
        self.say(f"background checkpoint failed ({error.one_line()}); saving step {step} now")
        try:
            self.save(blocking=True)
        except CheckpointError as again:
            raise CheckpointError(
                f"checkpoint failed twice (background, then a blocking retry at step {step}): "
                f"{again.message}",
                where=again.where,
                hint=again.hint
                or "fix the checkpoint directory, then resume: the last good checkpoint is kept",
            ) from again
