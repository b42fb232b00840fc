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
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import UserInputError
from ..fsutil import append_line
from ..rundir import STOPPED, AttemptOutcome, Ledger, read_events
from ..rundir.cause import STOP_EXIT_CODES, Cause
from ..rundir.events import CheckpointSaved, of_kind
from ..rundir.outcome import Status
from ..rundir.progress import PHASES
from .checkpoint import Checkpointer
from .data_position import DataPosition
from .dist import DistContext, all_gather_json, broadcast_json
from .memory_tier import MemoryTier
from .objects import Attached
from .periodic_saves import PeriodicSaves
from .restore import Restored, record_resumed, restore
from .rng import rng_digest
from .saving import DiskSaves
from .session import RankSession
from .step_log import StepLog
from .tensors import params_finite

__all__ = ["Run", "RunHooks", "Stopped"]

RECENT_SAVES = 8  # the run's newest saves among which the blocking ones seed an attempt's stop lead


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
        self.checkpointer = checkpointer
        self.memory = memory
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
        self._saves: PeriodicSaves | None = None
        self._disk: DiskSaves | None = None
        self._outside_s = 0.0  # time the current step spent in run.phase blocks
        self._step_began = 0.0
        self._current: int | None = None  # the step the script is in (None: between steps)
        self._logged: dict[str, Any] = {}  # the current step's run.log values (the trace's)
        self._trace: Path | None = None
        self._closed = False
        self._sleep_s = float(self.site.cfg.testing.step_sleep_s) if self.hooks.step_sleep else 0.0
        if checkpointer is not None:
            self._disk = DiskSaves(
                checkpointer,
                state=self._state,
                step=lambda: self.step,
                finite=self._finite,
                extra=self._manifest_extra,
                stop=self.stop,
                progress=self.progress,
                ledger=self.ledger,
                say=self.say,
            )

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
            checkpointer=self.checkpointer,
            memory=self.memory,
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
        while self.step < total:
            step = self.step + 1
            self._enter(step)
            yield step
            self._after(step)
        self._end(None)

    def _begin(self) -> None:
        self._seed_save_time()
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
        if self.checkpointer is not None:
            ledger = self.ledger
            self._saves = PeriodicSaves(
                self.site.cfg, self.ctx, self.site.paths, ledger, self.site.attempt, start_step=self.step,
                last_step=self.total or self.step,
            )  # fmt: skip
        if self.memory is not None:
            self.memory.start(self.step)
        if self.site.cfg.testing.trace_steps:
            self._trace = self.site.paths.root / "trace" / f"rank{self.ctx.rank}.jsonl"
            self._trace.parent.mkdir(parents=True, exist_ok=True)
            digests = self.attached.digests()  # (collective under FSDP: every rank traces)
            self._write_trace(
                {"kind": "begin", "step": self.step, "rng": rng_digest(), "objects": digests["objects"],
                 "params": digests["params_sha256"], "resumed_from": self.resumed_from}
            )  # fmt: skip

    def _seed_save_time(self) -> None:
        """The stop lead starts from the slowest of the run's recent blocking saves (an attempt too
        short to save before its stop would otherwise keep the plan's estimate for ever): rank 0
        reads the ledger, every rank hears (none: the plan's estimate)."""
        seconds = None
        if self.ledger is not None:
            recent = of_kind(read_events(self.site.paths).events, CheckpointSaved)[-RECENT_SAVES:]
            # (a stop's save is blocking: a background save's time is its writer's, starved or not)
            measured = [e.seconds for e in recent if e.seconds is not None and e.blocking]
            seconds = max(measured) if measured else None
        if self.ctx.initialized:
            seconds = broadcast_json(seconds, self.ctx.host_group(), is_source=self.ctx.is_main)
        if seconds is not None:
            self.stop.note_checkpoint_seconds(float(seconds))

    def _enter(self, step: int) -> None:
        self._current = step
        self._outside_s = 0.0
        self._logged = {}
        if not self.hooks.marks_phases:
            self.progress.phase("data", step)
            self.progress.phase("compute")
        else:
            self.progress.step = step
        if self._trace is not None:
            self._logged["_rng_begin"] = rng_digest()
        self._step_began = time.perf_counter()

    def _after(self, step: int) -> None:
        if self._sleep_s:
            time.sleep(self._sleep_s)
        dt = max(0.0, time.perf_counter() - self._step_began - self._outside_s)
        self.step, self._current = step, None
        self.progress.stepped(step, dt)
        if self._trace is not None:
            self._write_trace({"kind": "step", "step": step, **self._step_facts()})
        self._testing_knobs(step)
        if self.log_writer is not None:
            self.log_writer.stepped(step, dt)
        saves, disk = self._saves, self._disk
        if saves is not None and disk is not None:
            saves.observe(dt, self.checkpointer)
            disk.act_on_failed_background_save(self.ctx.host_group())
            saves.after_step(self.checkpointer, step)
        if self.total is not None and step >= self.total:
            return
        self.progress.phase("collective")
        cause = self.stop.check(step, dt)
        if cause is not None:
            self._end(cause)
            raise Stopped(cause, step)
        disk_now = saves is not None and saves.due(step)
        if disk_now and disk is not None and saves is not None:
            disk.save(blocking=False)
            saves.started(self.checkpointer, step)
        if self.memory is not None:
            self.memory.after_step(step, self._snapshot_state, disk_save_now=disk_now)

    def _end(self, cause: Cause | None) -> None:
        """The last save of this attempt (a stop's, or the run's end), then what the ledger says."""
        lead = self.stop.lead_fields()  # in force at the stop, before its own save is measured
        for hook in self.hooks.before_last_save:
            hook()
        if self.memory is not None:
            self.memory.drop_pending()
        if self._disk is not None:
            self._disk.save(blocking=True, supersede=cause is not None)
        if self.checkpointer is not None:
            self.checkpointer.wait()
        if self.memory is not None:  # the last save is on disk: the node's memory is freed
            self.memory.close(remove=True)
            self.memory = None
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
            self._write_trace({"kind": "end", "step": self.step, "cause": cause, "params": params})
        if self.checkpointer is not None and self.hooks.records_outcome:
            # nothing more is saved: the writer and the checkpointer's group go while the script's
            # process group (which a script may destroy after its loop) still exists
            self.checkpointer.close()
        self.progress.phase("done")

    # ---- what the script may call between steps ------------------------------------------------

    def log(self, **metrics: Any) -> None:
        """This step's metrics (rank 0's values): ``metrics.jsonl``, ``hpclaunch status`` and
        ``report``, TensorBoard. A tensor is read once here (a host sync: log every few steps on a
        GPU, or pass Python numbers)."""
        values = {k: _number(v) for k, v in metrics.items()}
        if self._trace is not None:
            self._logged.update(values)
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
        if self._disk is not None:
            self._disk.save(blocking=True)

    def before_update(self) -> None:
        """Before the live tensors change (an optimizer step, an EMA swapped in): the staging copies
        of a save or snapshot just begun are done (registered as a pre-hook of every attached
        optimizer's ``step``)."""
        if self.checkpointer is not None:
            self.checkpointer.before_update()
        if self.memory is not None:
            self.memory.before_update()

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
        mine = {"rank": self.ctx.rank, "step": self.step, **self.attached.digests()}
        ranks = list(all_gather_json(mine, self.ctx.host_group()))
        return AttemptOutcome(
            status=status,
            cause=cause,
            step=self.step,
            error=error,
            world_size=self.ctx.world_size,
            extra={
                "attempt": self.site.attempt,
                "total_steps": self.total,
                "params_sha256": ranks[0].get("params_sha256"),
                "ranks": ranks,
            },
        )

    def close(self) -> None:
        """Threads, writers and handlers of this run go (the memory tier keeps its snapshots for an
        in-place restart unless the run's last save is on disk)."""
        if self._closed:
            return
        self._closed = True
        if self.log_writer is not None:
            self.log_writer.close()
        if self.memory is not None:
            self.memory.close(remove=False)
        if self.checkpointer is not None:
            self.checkpointer.close()

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

    def _step_facts(self) -> dict[str, Any]:
        """verify-resume's record of a step: the random state at its start and end, every attached
        object's digest after it, and what was logged."""
        logged = dict(self._logged)
        return {
            "rng_begin": logged.pop("_rng_begin", None),
            "rng_end": rng_digest(),
            "objects": self.attached.digests(whole=False)["objects"],
            "logged": logged,
        }

    def _write_trace(self, record: dict[str, Any]) -> None:
        assert self._trace is not None
        record.update(attempt=self.site.attempt, world_size=self.ctx.world_size)
        append_line(self._trace, json.dumps(record))

    def _testing_knobs(self, step: int) -> None:
        """``testing.stop_at_step`` (rank 0 writes a user's stop, as ``hpclaunch stop`` does) and
        ``testing.crash_at_step`` (the last rank dies), each once per run (a marker file)."""
        t = self.site.cfg.testing
        if t.stop_at_step == step and self.ctx.is_main and _first_time(self.site.paths.attempts, "stop"):
            from ..rundir.control import write_user_stop

            write_user_stop(self.site.paths, continue_=False, attempt=None, by="testing.stop_at_step")
        last = self.ctx.rank == self.ctx.world_size - 1
        if t.crash_at_step == step and last and _first_time(self.site.paths.attempts, "crash"):
            print(
                f"hpclaunch: testing.crash_at_step: rank {self.ctx.rank} dies after step {step}", flush=True
            )
            os._exit(1)


def _first_time(directory: Path, what: str) -> bool:
    directory.mkdir(parents=True, exist_ok=True)
    try:
        os.close(os.open(directory / f"testing-{what}.fired", os.O_CREAT | os.O_EXCL, 0o644))
    except FileExistsError:
        return False
    return True


def _number(value: Any) -> float | int | None:
    if isinstance(value, torch.Tensor):
        value = value.detach().float().item() if value.numel() == 1 else None
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, (int, float)):
        return value
    return None
