"""One login flow for ``hpclaunch submit`` and ``train``: every step between a command's parsed
arguments and its run, in one order for both. The CLI parses (the config, the run named on the
command line), prints what the flow returns, and formats its errors; nothing here prints.

``submit``::

    resumed_config     --resume: the run's own config + --set, refused unless resumable now
    plan_submit        what a resume changes of the LR schedule; the plan and the job script
                       (the CLI prints the script's warnings here)
    submit_planned     --after's run, a live writer (a resume), the refusals, preflight; then the
                       run directory, lock and ledger, and the scheduler (launch.submit)
    settle_chain       --after: the held job tied to the earlier run (released, cancelled, held)

``train``::

    schedule_pin       --resume: the LR schedule's length as the run has it (the CLI reloads with it)
    plan_train         what the resume changes, the plan; refused: a sweep's root, a run already
                       there (without --resume), then the refusals, in submit's order
    foreground_run     the same run directory, lock and ledger as submit's, while the CLI runs
                       the agent in its own process
    foreground_outcome how the run ended (the CLI says so, and exits with its code)

Every refusal is a typed error (``errors``), raised before anything is written. Torch-free.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ..config import RunConfig
from ..errors import RunStateError, UserInputError
from ..lr_schedule import ResumeChange
from ..rundir import (
    SCHEDULE_CHANGED,
    STOP_DROPPED,
    SUBMITTED,
    AttemptOutcome,
    Heartbeat,
    Ledger,
    RunLock,
    RunPaths,
)
from ..rundir.cause import Cause
from ..rundir.chain import Verdict
from ..rundir.control import drop_user_stop
from ..rundir.readers import RunKind, what_is_at
from ..templates.shell import quote
from .launch import (
    Prepared,
    load_existing_run,
    prepare,
    refuse_if_locked,
    resume_change,
    scheduler_says_active,
    submit,
    write_run_dir,
)
from .refusals import refuse_before_writing, refuse_existing_run, resume_step
from .status import ENDING_STATES, StatusView


@dataclass(frozen=True)
class Planned:
    """A run planned and rendered, nothing written yet."""

    prepared: Prepared
    resume: bool
    change: ResumeChange | None = None  # what the resume changes of the LR schedule or the batch
    sweep: bool = False  # submitted with --sweep

    @property
    def cfg(self) -> RunConfig:
        return self.prepared.cfg

    @property
    def warnings(self) -> list[str]:
        return self.prepared.rendered.warnings

    @property
    def paths(self) -> RunPaths:
        return self.prepared.plan.paths()


@dataclass(frozen=True)
class Submitted:
    paths: RunPaths
    job_id: str
    scheduler: str
    after: RunPaths | None = None  # --after: the run this one is chained after


def resumed_config(run: RunPaths, overrides: list[str], look: Callable[[RunPaths], StatusView]) -> RunConfig:
    """``submit --resume RUN``: the config RUN was started with plus ``overrides``; refused when RUN
    cannot be resumed now (``look``: its status, the scheduler asked, once the config has loaded)."""
    cfg = load_existing_run(run.root, overrides)
    now = look(run)
    steps = None if cfg.is_script else cfg.train.steps
    refuse_unless_resumable_now(run, now.state, int(now.step or 0), steps)
    return cfg


def refuse_unless_resumable_now(paths: RunPaths, state: str, step: int, steps: int | None) -> None:
    """A finished run has nothing to train; one still exiting is not free yet (status says so).
    ``steps`` None: a script's run, whose new length only the script knows (its arguments)."""
    if state == "finished" and steps is not None:
        refuse_nothing_to_train(paths, step, steps, again=f"submit --resume {quote(str(paths.root))}")
    if state in ENDING_STATES.values():
        raise RunStateError(
            f"{paths.root} is {state}: its job has not exited yet; nothing was written",
            where="--resume",
            hint=f"resume it once hpclaunch status {quote(paths.root)} says it has ended (seconds)",
        )


def refuse_nothing_to_train(paths: RunPaths, step: int, steps: int, *, again: str) -> None:
    """A resume of a run that has trained its ``steps`` (``step``: how far it is) has nothing to do;
    ``again``: the command that resumes it (``submit --resume RUN``), told with a longer length."""
    if step >= steps:
        where = (
            f"has finished (step {step}/{steps})"
            if step == steps
            else f"is at step {step}, past train.steps={steps}"
        )
        raise RunStateError(
            f"{paths.root} {where}: there is nothing to resume",
            where="--resume",
            hint=f"to train it longer: hpclaunch {again} --set train.steps=N (N > {step})",
        )


def plan_submit(cfg: RunConfig, *, sweeps: list[str], resume: RunPaths | None) -> Planned:
    """The plan and job script of ``submit`` (``resume``: the run it continues)."""
    change = None
    if resume is not None and not cfg.is_script:  # (a script's schedule is its own)
        change = resume_change(resume, cfg, step=resume_step(cfg, resume.root))
    return Planned(prepare(cfg, sweeps=sweeps), resume is not None, change, sweep=bool(sweeps))


def submit_planned(
    planned: Planned, *, after: Path | None, preflight: Callable[[RunConfig], None] | None
) -> Submitted:
    """Refuse what cannot run (nothing written), run ``preflight`` (None: ``--no-preflight``), then
    write the run directory and hand the job to its scheduler, held when chained ``after`` a run."""
    prepared, cfg = planned.prepared, planned.cfg
    after_paths = None
    if after is not None:
        from .chain_submit import check_after

        after_paths = check_after(after, planned.paths.root, sweep=planned.sweep)
    if planned.resume:
        refuse_if_locked(prepared.plan)
    # Chained after the run it starts from: that run may have no checkpoint yet.
    pending = after_paths is not None and Path(cfg.train.init_from or "").resolve() == after_paths.root
    refuse_before_writing(
        cfg,
        planned.paths.root,
        resume=planned.resume,
        ranks_here=prepared.plan.scheduler == "local",
        data_of=None if preflight is None else prepared.point_cfgs,  # bad input: one line, before the table
        pending_ok=pending,
    )
    if preflight is not None:
        preflight(cfg)
    paths, job_id = submit(
        prepared,
        run_preflight=preflight is not None,
        resume=planned.resume,
        held=after_paths is not None,
        change=planned.change,
    )
    return Submitted(paths, job_id, prepared.plan.scheduler, after_paths)


def settle_chain(submitted: Submitted) -> Verdict | None:
    """``--after``: tie the held job to the earlier run; released or cancelled now if that run has
    ended already (None: not chained)."""
    if submitted.after is None:
        return None
    from .chain_submit import register_and_settle

    return register_and_settle(submitted.after, submitted.paths, submitted.scheduler, submitted.job_id)


def schedule_pin(cfg: RunConfig, overrides: list[str]) -> str | None:
    """``train --resume``: the override that keeps the LR schedule's length as the run recorded it
    where ``overrides`` change ``train.steps`` (as for ``submit --resume``); None: nothing to pin."""
    from ..lr_schedule import pinned_length
    from ..rundir import read_config

    recorded = RunPaths(cfg.run_path())
    if not recorded.config.is_file() or cfg.is_script:
        return None
    return pinned_length(read_config(recorded).train, cfg.train, overrides)


def plan_train(cfg: RunConfig, *, resume: bool) -> Planned:
    """The plan of a foreground ``train``, every refusal passed (nothing written yet)."""
    recorded = RunPaths(cfg.run_path())
    change = None
    if resume and recorded.config.is_file() and not cfg.is_script:
        first = resume_step(cfg, recorded.root)
        refuse_nothing_to_train(
            recorded, first - 1, cfg.train.steps, again=f"train {quote(str(recorded.root))} --resume"
        )
        change = resume_change(recorded, cfg, step=first)
    planned = Planned(prepare(cfg), resume, change)
    root = planned.paths.root
    refuse_training_in_a_sweep_root(root)
    if not resume:
        refuse_existing_run(root, hint="add --resume to continue it, or change name/run_dir", by_config=False)
    refuse_before_writing(cfg, root, resume=resume, ranks_here=True)
    return planned


def refuse_training_in_a_sweep_root(root: Path) -> None:
    """``train`` whose run directory is a sweep's root would put a run where its points' sweep is."""
    there = what_is_at(root)
    if there.kind is RunKind.SWEEP:
        raise UserInputError(
            f"{there.describe()}; training here would make its root a run; nothing was written",
            where="run_dir",
            hint=f"train one point (hpclaunch submit --resume {quote(there.points[0])}) or choose another name/run_dir",
        )


@contextmanager
def foreground_run(planned: Planned) -> Iterator[RunPaths]:
    """``hpclaunch train``'s run directory while its attempts run in this process: the run lock held
    (its heartbeat tells another host sharing the filesystem that the run is alive), the run
    directory written, a resume's dropped stop and schedule change recorded, and the submission in
    the ledger, as ``submit`` records a job's."""
    from ..schedulers import foreground

    prepared, resume, change = planned.prepared, planned.resume, planned.change
    paths = prepared.plan.paths()
    job_id = foreground.job_id()  # the job id the in-process agent sees (no HPCLAUNCH_JOB_ID)
    lock = RunLock(paths)
    holder = lock.acquire(
        job_id=job_id, scheduler="local", role="train", is_active=scheduler_says_active(paths)
    )
    try:
        with Heartbeat(lock, holder):
            write_run_dir(prepared.cfg, prepared.plan, prepared.rendered)
            ledger = Ledger(paths, role="cli")
            dropped = drop_user_stop(paths) if resume else None
            if dropped is not None:
                ledger.append(STOP_DROPPED, by=dropped.by, requested_at=dropped.requested_at)
            if change is not None:
                ledger.append(SCHEDULE_CHANGED, **change.fields())
            ledger.append(SUBMITTED, job_id=job_id, scheduler="foreground", resume=resume)
            yield paths
    finally:
        lock.release(holder)


def foreground_outcome(paths: RunPaths) -> AttemptOutcome | None:
    """How a foreground run's last attempt ended (None: it left no outcome). The decision, not only
    the trainer's outcome, says which: a cancel reaches the ranks as a SIGTERM, which the trainer
    alone cannot tell from a preemption."""
    from .. import rundir  # (looked up at the call: tests stand in for the outcome)
    from ..rundir import read_events
    from .status import attempts_from_events

    outcome = rundir.latest_outcome(paths)
    attempts = attempts_from_events(read_events(paths).events)
    if outcome is not None and attempts and attempts[-1].end == "cancelled":
        return AttemptOutcome("stopped", Cause.CANCELLED, outcome.step)
    return outcome
