"""The loop's disk saves: a checkpoint of the state after the current step, and what is done when a
background save failed.

A save first waits for the previous background save (should it have failed unseen), refuses
parameters that are not finite, and tells the stop controller how long it took (the deadline keeps
room for the next one). A background save that failed is saved again at once, blocking, and the
ledger says so (``checkpoint_failed``); a second failure stops the run with the reason.

The checkpointer and the state are passed at each call rather than held: ``Trainer.checkpointer``
and ``Trainer.app_state`` are what a save uses at that moment (``bench/checkpoint_stall.py`` swaps
the one and times the other).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from torch import nn

from ..errors import CheckpointError, TrainingError
from ..jobs.stop import StopController
from ..rundir import CHECKPOINT_FAILED
from .rank_progress import Progress
from .rank_run import RankRun
from .reports import Reports
from .state import params_finite

if TYPE_CHECKING:
    from .checkpoint import Checkpointer

__all__ = ["CheckpointSaves"]

AppState = Callable[[], dict[str, object]]  # everything a checkpoint holds (``Trainer.app_state``)


class CheckpointSaves:
    """One rank's saves through the trainer's checkpointer (every call collective)."""

    def __init__(
        self,
        run: RankRun,
        *,
        model: nn.Module,
        sharded: bool,
        ema: bool,
        stop: StopController,
        progress: Progress,
        reports: Reports,
    ) -> None:
        self.cfg, self.ctx = run.cfg, run.ctx
        self.model, self.sharded, self.ema = model, sharded, ema
        self.counters = run.counters
        self.stop, self.progress, self.ledger, self.reports = stop, progress, run.ledger, reports

    def save(
        self, checkpointer: Checkpointer, app_state: AppState, *, blocking: bool, supersede: bool = False
    ) -> None:
        """Checkpoint the state after step ``counters.step`` (collective). ``supersede``: a stop's
        save; a background save still writing is dropped rather than waited for (this step is
        newer, and the deadline keeps no room for a writer starved of CPU or still starting)."""
        try:
            # the previous background save, should it have failed unseen
            checkpointer.wait(supersede=supersede)
        except CheckpointError as error:
            return self._save_again_after(error, checkpointer, app_state)
        if not params_finite(self.model, sharded=self.sharded):
            raise TrainingError(
                f"parameters are not finite after step {self.counters.step}; refusing to checkpoint them"
            )
        t0 = time.perf_counter()
        c = self.counters
        self.progress.phase("save")
        checkpointer.save(c.step, app_state(), blocking=blocking, extra=self.extra())
        if blocking:
            self.stop.note_checkpoint_seconds(time.perf_counter() - t0)
        elif checkpointer.last_save_seconds is not None:
            self.stop.note_checkpoint_seconds(checkpointer.last_save_seconds)

    def extra(self) -> dict[str, object]:
        """What a checkpoint's manifest says beside the state."""
        c = self.counters
        return {
            "samples_consumed": c.samples_consumed,
            "skipped_total": c.skipped_total,
            "parallel": self.cfg.train.parallel,
            "ema": self.ema,
            "model": self.cfg.model.model_dump(mode="json"),  # names what differs on a refusal
        }

    def act_on_failed_background_save(self, checkpointer: Checkpointer, app_state: AppState) -> None:
        """A background save that failed is saved again now, blocking; if that fails too, the run
        stops with the reason (collective while a background save is pending). One that settled
        is a measured save for the deadline's lead from this step on: without it an attempt whose
        only save so far ran in the background stops with the plan's estimate, which a loaded
        machine outruns (the PBS walltime test saved 0.3 s past the walltime that way)."""
        settled = checkpointer.settled_saves
        error = checkpointer.poll_background(self.ctx.host_group())
        if error is not None:
            self._save_again_after(error, checkpointer, app_state)
        elif checkpointer.settled_saves != settled and checkpointer.last_save_seconds is not None:
            self.stop.note_checkpoint_seconds(checkpointer.last_save_seconds)

    def _save_again_after(
        self, error: CheckpointError, checkpointer: Checkpointer, app_state: AppState
    ) -> None:
        step = self.counters.step
        if self.ledger is not None:
            self.ledger.append(CHECKPOINT_FAILED, step=step, error=error.one_line(), action="blocking retry")
        self.reports.message(f"background checkpoint failed ({error.one_line()}); saving step {step} now")
        try:
            self.save(checkpointer, app_state, blocking=True)
        except CheckpointError as again:
            raise CheckpointError(
                f"checkpoint failed twice (background, then a blocking retry at step {step}): "
                f"{again.message}",
                where=again.where,
                hint=again.hint
                or "fix the checkpoint directory, then resume: the last good checkpoint is kept",
            ) from again
