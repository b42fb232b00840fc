"""``Run``: one rank's training run as the script (or the MMDiT trainer) sees it.

``Run.steps(total)`` owns the boundary between steps. It yields the steps still to do, after
whatever ``attach`` restored; when the script asks for the next one, the work between steps runs,
in this order, on every rank at the same step:

1. the step's time is measured (minus the time the script spent in ``run.phase`` blocks) and
   reported (progress for the watchdog, the save interval's and the stop check's estimates);
2. a background save that failed is saved again (blocking), one that settled is measured;
3. the stop agreement (every k steps, ``stop.StopController``): if the ranks agree to stop, the
   state after this step is saved to disk, blocking, once, the ledger says why, and
   ``Stopped`` (a ``SystemExit``) leaves the script's loop: the code after it runs only when the run
   is done;
4. a periodic save to disk when due (in the background), and a snapshot to the memory tier when due.

After the last step the state is saved once more (blocking) and the loop ends; the memory tier's
snapshots of this run are freed on this node. Nothing runs inside the script's step and nothing in
a signal handler: signals and deadlines only set the flag that step 3 agrees on.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import UserInputError
from ..rundir import STOPPED, AttemptOutcome, Ledger
from ..rundir.cause import STOP_EXIT_CODES, Cause
from ..rundir.outcome import Status
from ..rundir.progress_files import PHASES
from .checkpoint import Checkpointer
from .data_position import DataPosition
from .dist import DistContext
from .ending import gathered_outcome
from .memory_tier import MemoryTier
from .objects import Attached
from .periodic_saves import PeriodicSaves
from .restore import Restored, record_resumed, restore
from .saving import DiskSaves, SavedState, seed_stop_lead
from .session import RankSession
from .state_saves import StateSaves
from .step_log import StepLog
from .step_trace import StepTrace
from .tensors import params_finite
from .testing_knobs import fire_testing_knobs, step_sleep_s, stops_at

__all__ = ["Run", "RunHooks", "Stopped"]


class Stopped(SystemExit):
    """The ranks agreed to stop after ``step`` for ``cause``; the state after it is saved.

    A ``SystemExit``: a script that does not catch it ends with ``code`` (3 a user's stop, 4 the
    time limit, 5 a preemption), and the code after its loop does not run until the run is done."""

    def __init__(self, cause: Cause, step: int) -> None:
        super().__init__(STOP_EXIT_CODES.get(cause, 3))
        self.cause, self.step = cause, step

    def __str__(self) -> str:
        return f"stopped after step {self.step}: {self.cause}"


@dataclass
class RunHooks:
    """What the built-in MMDiT trainer adds to a run (a script's run needs none of it)."""

    manifest_extra: Callable[[], dict[str, Any]] = dict  # beside the state, in each manifest
    before_last_save: list[Callable[[], None]] = field(default_factory=list)  # a stop's or the end's
    resumed_fields: Callable[[], dict[str, Any]] = dict
    on_stopped: Callable[[Cause, int], None] | None = None
    on_finished: Callable[[int], None] | None = None
    marks_phases: bool = False  # the step sets its own progress phases (data, compute)
    step_sleep: bool = True  # the run adds testing.step_sleep_s to each step (else the step does)
    records_outcome: bool = True  # the run takes the attempt's outcome at its end (else its owner does)
    sharded: bool = False  # parameters are FSDP shards (the finite check agrees over the ranks)


class Run:
    """One rank's run (see the module docstring). Made by ``attach``."""

    def __init__(
        self,
        session: RankSession,
        ctx: DistContext,
        attached: Attached,
        *,
        checkpointer: Checkpointer | None,
        memory: MemoryTier | None,
        hooks: RunHooks | None = None,
        echo: bool = True,
    ) -> None:
        self.session = session
        self.site = session.site
        self.ctx = ctx
        self.attached = attached
        self.hooks = hooks or RunHooks()
        self.stop = session.stop
        self.progress = session.progress
        self.step = 0  # steps completed
        self.total: int | None = None
        self.restored = Restored()
        self.cause: Cause | None = None  # why the run stopped (None: running, or finished)
        self.finished = False
        self.outcome_record: AttemptOutcome | None = None  # the attempt's end, once known
        self.log_writer: StepLog | None = None
        self._echo = echo
        self._outside_s = 0.0  # time the current step spent in run.phase blocks
        self._step_began = 0.0
        self._current: int | None = None  # the step the script is in (None: between steps)
        self._trace: StepTrace | None = None  # testing.trace_steps (verify-resume's record)
        self._closed = False
        self.saves = StateSaves(checkpointer, memory, _disk_saves(self, checkpointer))

    # ---- what the script reads ----------------------------------------------------------------

    @property
    def rank(self) -> int:
        return self.ctx.rank

    @property
    def world_size(self) -> int:
        return self.ctx.world_size

    @property
    def run_dir(self) -> Any:
        return self.site.paths.root

    @property
    def ledger(self) -> Ledger | None:
        return self.session.ledger

    @property
    def resumed_from(self) -> str | None:
        """``memory``, ``disk``, or None (a fresh start)."""
        return self.restored.source

    def batches(self) -> Iterator[Any]:
        """An endless iterator over ``attach(data=loader)``: one epoch after another, each begun with
        the sampler's ``set_epoch``; after a resume, at the exact batch the run stopped at."""
        if self.attached.data is None:
            raise UserInputError(
                "run.batches() needs attach(data=your DataLoader)", where="hpclaunch.attach()"
            )
        data: DataPosition = self.attached.data
        return data.batches()

    # ---- the restore point -----------------------------------------------------------------------

    def restore(self) -> Restored:
        """Collective (``attach`` calls it): the newest state into the attached objects."""
        self.progress.phase("load")
        self.restored = restore(
            self.attached,
            ctx=self.ctx,
            paths=self.site.paths,
            checkpointer=self.saves.checkpointer,
            memory=self.saves.memory,
        )
        self.step = self.restored.step
        self.session.startup.mark("load")
        return self.restored

    # ---- the loop -------------------------------------------------------------------------------

    def steps(self, total: int) -> Iterator[int]:
        """The steps still to do (``step + 1 .. total``); see the module docstring."""
        if isinstance(total, bool) or not isinstance(total, int) or total < 0:
            raise UserInputError(
                f"run.steps(total={total!r}): a whole number of steps >= 0", where="run.steps()"
            )
        if self.total is not None:
            raise UserInputError("run.steps() is called once per attach()", where="run.steps()")
        self.total = total
        self._begin()
        if self.step >= total and self.restored.source is not None:
            self.say(
                f"nothing to train: the run is at step {self.step} of {total} (restored from "
                f"{self.site.paths.root}); to train it longer, raise the total; for a new run, another run_dir"
            )
        while self.step < total:
            step = self.step + 1
            self._enter(step)
            yield step
            self._after(step)
        self._end(None)

    def _begin(self) -> None:
        seed_stop_lead(self.stop, self.ctx, self.site.paths if self.ledger is not None else None)
        if self.ledger is not None:
            record_resumed(
                self.ledger,
                self.restored,
                self.ctx,
                startup=self.session.startup,
                total=self.total,
                **self.hooks.resumed_fields(),
            )
        if self.ctx.is_main:
            self.log_writer = StepLog(
                self.site.paths,
                attempt=self.site.attempt,
                total=self.total,
                start_step=self.step,
                echo=self._echo,
            )
        periodic = None
        if self.saves.checkpointer is not None:
            periodic = PeriodicSaves(
                self.site, self.ctx, self.ledger, start_step=self.step, last_step=self.total or self.step
            )
        self.saves.begin(periodic, self.step)
        if self.site.cfg.testing.trace_steps:
            self._trace = StepTrace(
                self.site.paths.root, rank=self.ctx.rank, attempt=self.site.attempt,
                world_size=self.ctx.world_size, attached=self.attached,
            )  # fmt: skip
            self._trace.begin(self.step, self.resumed_from)

    def _enter(self, step: int) -> None:
        self._current = step
        self._outside_s = 0.0
        if not self.hooks.marks_phases:
            self.progress.phase("data", step)
            self.progress.phase("compute")
        else:
            self.progress.step = step
        if self._trace is not None:
            self._trace.enter()
        self._step_began = time.perf_counter()

    def _after(self, step: int) -> None:
        if self.hooks.step_sleep and (
            sleep_s := step_sleep_s(self.site.cfg, resumed=self.resumed_from is not None)
        ):
            time.sleep(sleep_s)  # (a test's knob: a healthy run makes no call here)
        dt = max(0.0, time.perf_counter() - self._step_began - self._outside_s)
        self.step, self._current = step, None
        self.progress.stepped(step, dt)
        if self._trace is not None:
            self._trace.stepped(step)
        fire_testing_knobs(self.site.cfg, self.site.paths, self.ctx, step)
        if self.log_writer is not None:
            self.log_writer.stepped(step, dt)
        self.saves.after_step(step, dt, self.ctx.host_group())
        if self.total is not None and step >= self.total:
            return
        self.progress.phase("collective")
        if stops_at(self.site.cfg, step):
            self.stop.check_at(step)
        cause = self.stop.check(step, dt)
        if cause is not None:
            self._end(cause)
            raise Stopped(cause, step)
        self.saves.when_due(step, self._snapshot_state)

    def _end(self, cause: Cause | None) -> None:
        """The last save of this attempt (a stop's, or the run's end), then what the ledger says."""
        lead = self.stop.lead_fields()  # in force at the stop, before its own save is measured
        for hook in self.hooks.before_last_save:
            hook()
        self.saves.last_save(stopping=cause is not None)
        if cause is not None:
            self.cause = cause
            if self.ledger is not None:
                self.ledger.append(STOPPED, cause=cause, step=self.step, **lead)
            if self.hooks.on_stopped is not None:
                self.hooks.on_stopped(cause, self.step)
            self.say(f"stopped after step {self.step} ({cause}); the state after it is saved")
        else:
            self.finished = True
            if self.hooks.on_finished is not None:
                self.hooks.on_finished(self.step)
        if self.hooks.records_outcome:  # (collective, while the script's group still exists)
            self.outcome_record = self.outcome("stopped" if cause is not None else "finished", cause)
        if self._trace is not None:
            params = self.outcome_record.extra.get("params_sha256") if self.outcome_record else None
            self._trace.end(self.step, cause, params)
        if self.saves.checkpointer is not None and self.hooks.records_outcome:
            # nothing more is saved: the writer and the checkpointer's group go while the script's
            # process group (which a script may destroy after its loop) still exists
            self.saves.checkpointer.close()
        self.progress.phase("done")

    # ---- what the script may call between steps ------------------------------------------------

    def log(self, **metrics: Any) -> None:
        """This step's metrics (rank 0's values): ``metrics.jsonl``, ``hpclaunch status`` and
        ``report``, TensorBoard. A tensor is read once here (a host sync: log every few steps on a
        GPU, or pass Python numbers)."""
        values = {k: _number(v) for k, v in metrics.items()}
        if self._trace is not None:
            self._trace.logged(values)
        if self.log_writer is not None:
            self.log_writer.log(self._current if self._current is not None else self.step, values)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """A phase of the step that is not training (``eval``, ``export`` ...): the watchdog gives it
        the long window (``watchdog.checkpoint_s``) instead of the step's, and its time is not step
        time."""
        shown = name if name in PHASES and name not in ("startup", "done") else "eval"
        before = self.progress.current
        began = time.perf_counter()
        self.progress.phase(shown)
        try:
            yield
        finally:
            self._outside_s += time.perf_counter() - began
            self.progress.phase(before if before in PHASES else "compute")

    def save(self) -> None:
        """Save the state after the current step now, blocking (collective: every rank calls it)."""
        self.saves.save_now()

    def before_update(self) -> None:
        """Before the live tensors change (an optimizer step, an EMA swapped in): the staging copies
        of a save or snapshot just begun are done (registered as a pre-hook of every attached
        optimizer's ``step``)."""
        self.saves.before_update()

    def say(self, text: str) -> None:
        """A line on rank 0's console."""
        if self.ctx.is_main:
            if self.log_writer is not None:
                self.log_writer.message(text)
            else:
                print(f"hpclaunch: {text}", flush=True)

    # ---- the end --------------------------------------------------------------------------------

    def outcome(self, status: Status, cause: Cause | None, error: str | None = None) -> AttemptOutcome:
        """The attempt's outcome with every rank's digests (collective: every rank calls it)."""
        return gathered_outcome(
            self.ctx, self.attached, self.step, (status, cause, error),
            attempt=self.site.attempt, total=self.total,
        )  # fmt: skip

    def close(self) -> None:
        """Threads, writers and handlers of this run go (the memory tier keeps its snapshots for an
        in-place restart unless the run's last save is on disk)."""
        if self._closed:
            return
        self._closed = True
        if self.log_writer is not None:
            self.log_writer.close()
        self.saves.close()

    # ---- state -----------------------------------------------------------------------------------

    def _state(self) -> dict[str, Any]:
        return self.attached.state({"step": self.step})

    def _snapshot_state(self) -> dict[str, Any]:
        return self.attached.state({"step": self.step}, cached=True)

    def _finite(self) -> bool:
        model = self.attached.model
        return model is None or params_finite(model, sharded=self.hooks.sharded)

    def _manifest_extra(self) -> dict[str, Any]:
        return {"objects": self.attached.names, "total_steps": self.total, **self.hooks.manifest_extra()}


def _disk_saves(run: Run, checkpointer: Checkpointer | None) -> DiskSaves | None:
    """``run``'s saves to disk (periodic and at a stop) of its attached state; None without a
    checkpointer."""
    if checkpointer is None:
        return None
    saved = SavedState(state=run._state, step=lambda: run.step, finite=run._finite, extra=run._manifest_extra)
    return DiskSaves(
        checkpointer, saved, stop=run.stop, progress=run.progress, ledger=run.ledger, say=run.say
    )


def _number(value: Any) -> float | int | None:
    if isinstance(value, torch.Tensor):
        value = value.detach().float().item() if value.numel() == 1 else None
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, (int, float)):
        return value
    return None
