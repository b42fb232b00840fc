"""Login-node flow's parts: config -> plan -> script -> (preflight) -> run directory -> submit. The
order ``submit`` and ``train`` take them in is ``login_flow``'s.

``render`` and ``submit`` share this code path, so what ``hpclaunch render`` prints is byte for byte
what ``submit`` hands to the scheduler. Nothing is written before every check has passed: a bad
input leaves no half-made run directory behind.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..config import RunConfig, apply_override, validate_config
from ..errors import HpclaunchError, UserInputError
from ..fsutil import atomic_write_json, atomic_write_text
from ..lr_schedule import ResumeChange
from ..rundir import (
    PREFLIGHT_SKIPPED,
    SCHEDULE_CHANGED,
    STOP_DROPPED,
    SUBMIT_FAILED,
    SUBMITTED,
    SUBMITTING,
    JobPlan,
    Ledger,
    LockHolder,
    RunLock,
    RunPaths,
    SweepPoint,
    read_config,
)
from ..rundir.control import drop_user_stop
from ..rundir.plan import write_plan
from ..schedulers.protocol import RenderedJob, Scheduler, write_script
from ..schedulers.registry import get_scheduler
from ..schedulers.rescue_job import leave_rescue
from ..templates.shell import quote
from . import plan_build as plan_mod
from .refusals import refuse_existing_run


@dataclass
class Prepared:
    cfg: RunConfig
    plan: JobPlan
    rendered: RenderedJob
    point_cfgs: list[RunConfig] = field(default_factory=list)  # one per sweep point


def nccl_plan_env(cfg: RunConfig) -> dict[str, str]:
    """Variables of an explicitly named preset + the user's; ``auto`` is resolved on each node."""
    from ..nccl import static_preset_env

    env: dict[str, str] = {}
    if cfg.backend == "nccl":
        # Never detect on the login node: its fabric is not the compute nodes'.
        env.update(static_preset_env(cfg.nccl.preset))
    env.update(cfg.nccl.env)
    return env


def expand_sweep(cfg: RunConfig, sweeps: list[str]) -> list[tuple[str, list[str], RunConfig]]:
    """``k=a,b`` x ``j=c,d`` -> the cartesian product: (point name, overrides, config) each. Values
    that are lists themselves (a script's arguments) are separated by ``;`` instead:
    ``script.args=[--lr,1e-3];[--lr,3e-4]``."""
    axes: list[list[str]] = []
    for item in sweeps:
        key, sep, values = item.partition("=")
        if not sep or not key.strip() or not values.strip():
            raise UserInputError(
                f"--sweep {item!r} is not key=v1,v2,...",
                where="--sweep",
                hint="e.g. --sweep train.lr=1e-4,3e-4",
            )
        if key.strip().split(".")[0] in ("scheduler", "name", "run_dir"):
            raise UserInputError(
                f"--sweep {key.strip()}: one job array shares its resources and name",
                where="--sweep",
                hint="sweep model/train/data/checkpoint keys; submit separate runs for other resources",
            )
        sep = ";" if ";" in values else ","
        axes.append([f"{key.strip()}={v.strip()}" for v in values.split(sep) if v.strip()])
    points = []
    root = cfg.run_path()
    for index, combo in enumerate(itertools.product(*axes)):
        raw = cfg.to_dict()
        for override in combo:
            apply_override(raw, override, where="--sweep")
        label = "-".join(o.split("=", 1)[0].rsplit(".", 1)[-1] + o.split("=", 1)[1] for o in combo)
        name = _safe_name(f"p{index}-{label}")[:60]
        raw["run_dir"] = str(root / name)
        raw["name"] = _safe_name(f"{cfg.name}-{name}")
        # The base config was valid: whatever fails now, the point's --sweep values made it so.
        where = f"--sweep point {index} ({', '.join(combo)})"
        points.append((name, list(combo), validate_config(raw, where=where)))
    return points


def _safe_name(name: str) -> str:
    cleaned = "".join(c if c.isalnum() or c in "._-" else "_" for c in name)
    return cleaned[:64]


def prepare(cfg: RunConfig, *, sweeps: list[str] | None = None) -> Prepared:
    """Plan + rendered script (lint included). Pure apart from reading templates."""
    python = sys.executable
    if sweeps:
        points = expand_sweep(cfg, sweeps)
        sweep = [
            SweepPoint(index=i, name=n, run_dir=str(c.run_path()), overrides=o)
            for i, (n, o, c) in enumerate(points)
        ]
        base = plan_mod.build(cfg, python=python, nccl_env=nccl_plan_env(cfg))
        plan = base.model_copy(update={"sweep": sweep})
        rendered = _with_config_warnings(get_scheduler(cfg.scheduler.kind).render(plan), cfg)
        return Prepared(cfg, plan, rendered, [c for _, _, c in points])
    plan = plan_mod.build(cfg, python=python, nccl_env=nccl_plan_env(cfg))
    rendered = _with_config_warnings(get_scheduler(cfg.scheduler.kind).render(plan), cfg)
    return Prepared(cfg, plan, rendered)


def _with_config_warnings(rendered: RenderedJob, cfg: RunConfig) -> RenderedJob:
    """What ``render`` and ``submit`` warn about beside the script's lint: a job asking for fewer
    CPUs than its ranks keep busy (``preflight`` says the same)."""
    shortfall = cfg.cpu_shortfall()
    return rendered if shortfall is None else replace(rendered, warnings=[*rendered.warnings, shortfall])


def write_run_dir(cfg: RunConfig, plan: JobPlan, rendered: RenderedJob | None) -> RunPaths:
    """config.yaml (what actually runs), plan.json and the job script (a sweep's root: no
    checkpoints, attempts or ledger of its own; each point has them)."""
    paths = plan.paths().ensure_sweep_root() if plan.sweep else plan.paths().ensure()
    atomic_write_text(paths.config, cfg.to_yaml())
    write_plan(paths, plan)
    if rendered is not None:
        write_script(paths, rendered)
    return paths


def scheduler_says_active(paths: RunPaths) -> Callable[[LockHolder], bool | None]:
    """The lock's question "is this job still pending or running?", asked of its scheduler."""

    def active(holder: LockHolder) -> bool | None:
        if not holder.job_id:
            return False
        try:
            return get_scheduler(holder.scheduler).status(paths, holder.job_id).active
        except (HpclaunchError, ValueError):
            return None  # cannot ask: the lock assumes the other writer is alive, and says so

    return active


def refuse_if_locked(plan: JobPlan) -> None:
    """Before any check or write: a run (or sweep point) held by a live writer is refused."""
    from ..errors import RunLockedError
    from ..rundir.lock import liveness

    for root in [Path(p.run_dir) for p in plan.sweep] or [Path(plan.run_dir)]:
        paths = plan.paths(str(root))
        holder = RunLock(paths).read()
        live = liveness(holder, is_active=scheduler_says_active(paths)) if holder is not None else None
        if holder is not None and live is not None and live.alive:
            raise RunLockedError(
                f"this run is active: {holder.describe()} ({live.why})",
                where=str(paths.root),
                hint=f"stop it first (hpclaunch stop {quote(paths.root)}), or wait until it ends",
            )


def submit(
    prepared: Prepared,
    *,
    run_preflight: bool = True,
    resume: bool = False,
    held: bool = False,
    change: ResumeChange | None = None,
) -> tuple[RunPaths, str]:
    """Write the run directory (one per sweep point), take each run's lock and hand the rendered
    script to the scheduler. A run whose lock is held by a live writer is refused (nothing written).
    ``held``: the job waits until released (a chain's next stage, see ``orchestrator.chain_submit``);
    ``change``: what this resume changes of the LR schedule or the batch, recorded before submitting."""
    plan, rendered = prepared.plan, prepared.rendered
    scheduler = get_scheduler(plan.scheduler)
    roots = [Path(p.run_dir) for p in plan.sweep] or [Path(plan.run_dir)]
    if not resume:
        for root in {Path(plan.run_dir), *roots}:
            refuse_existing_run(
                root,
                hint=f"continue it with 'hpclaunch submit --resume {quote(root)}', or choose another name/run_dir",
            )
    # The lock first, before anything is written: a second writer is refused with nothing changed.
    locks = [(RunLock(plan.paths(str(r))), r) for r in roots]
    taken: list[tuple[RunLock, LockHolder]] = []
    ledgers = [Ledger(plan.paths(str(r)), role="cli") for r in roots]
    submission = {
        "scheduler": plan.scheduler,
        "script": rendered.filename,
        "resume": resume,
        "world_size": plan.world_size,
        "preflight": "passed" if run_preflight else "skipped",
    }
    try:
        for lock, root in locks:
            active = scheduler_says_active(plan.paths(str(root)))
            taken.append(
                (lock, lock.acquire(job_id="", scheduler=plan.scheduler, role="job", is_active=active))
            )
        for ledger in ledgers:
            if resume:  # a stop asked for before the run ended is not the resumed run's
                dropped = drop_user_stop(ledger.paths)
                if dropped is not None:
                    ledger.append(STOP_DROPPED, by=dropped.by, requested_at=dropped.requested_at)
            if not run_preflight:
                ledger.append(PREFLIGHT_SKIPPED, by="--no-preflight")
            if change is not None:
                ledger.append(SCHEDULE_CHANGED, **change.fields())
            # Recorded before the scheduler is asked: the job may start (and read the ledger to see
            # whether its run has ended) before the scheduler's answer comes back.
            ledger.append(SUBMITTING, **submission)
        paths, job_id, targets = _write_and_submit(prepared, scheduler, held=held)
    except BaseException as e:
        for lock, holder in taken:
            lock.release(holder)
        for ledger in ledgers if taken else []:
            ledger.append(SUBMIT_FAILED, error=str(e) or type(e).__name__)
        raise
    for (lock, holder), (target, target_job) in zip(taken, targets, strict=True):
        _name_the_job(lock, holder, target_job)
        Ledger(target, role="cli").append(SUBMITTED, job_id=target_job, **submission)
    # The job's rescue: continues the run if the scheduler ends the job before an agent decides.
    leave_rescue(scheduler, plan, paths, job_id, role="cli")
    return paths, job_id


def _name_the_job(lock: RunLock, holder: LockHolder, job_id: str) -> None:
    """Put the job id into the lock we took, unless the job's own process has adopted it already."""
    current = lock.read()
    if current is not None and current.pid == holder.pid and current.role == "job" and not current.job_id:
        lock.set(replace(current, job_id=job_id, pid=0))


def _write_and_submit(
    prepared: Prepared, scheduler: Scheduler, *, held: bool = False
) -> tuple[RunPaths, str, list[tuple[RunPaths, str]]]:
    plan, cfg, rendered = prepared.plan, prepared.cfg, prepared.rendered
    paths = write_run_dir(cfg, plan, rendered)
    points = []
    for point_cfg in prepared.point_cfgs:
        # Each point has its own plan and a plain (non-array) script: continuation jobs submit it.
        point_plan = plan_mod.build(point_cfg, python=plan.python, nccl_env=nccl_plan_env(point_cfg))
        point_script = scheduler.render(point_plan)
        points.append((write_run_dir(point_cfg, point_plan, point_script), point_plan, point_script))
    if plan.sweep:
        atomic_write_json(paths.sweep, {"job_id": None, "points": [p.model_dump() for p in plan.sweep]})
    if not plan.sweep:
        job_id = scheduler.submit_held(plan, rendered) if held else scheduler.submit(plan, rendered)
        targets = [(paths, job_id)]
    elif plan.scheduler == "local":  # no arrays here: one controller per point
        targets = [(p, scheduler.submit(pp, ps)) for p, pp, ps in points]
        job_id = ",".join(j for _, j in targets)
    else:
        job_id = scheduler.submit(plan, rendered)
        targets = [(p, array_task_id(plan.scheduler, job_id, i)) for i, (p, _, _) in enumerate(points)]
    if plan.sweep:
        atomic_write_json(paths.sweep, {"job_id": job_id, "points": [p.model_dump() for p in plan.sweep]})
    return paths, job_id, targets


def array_task_id(scheduler: str, job_id: str, index: int) -> str:
    """One task of an array job: SLURM ``12_3``; PBS Pro ``12[3].server`` (qsub answers ``12[].server``)."""
    if scheduler == "slurm":
        return f"{job_id}_{index}"
    if "[]" in job_id:
        return job_id.replace("[]", f"[{index}]", 1)
    return f"{job_id}[{index}]"


def load_existing_run(run: Path, overrides: list[str]) -> RunConfig:
    """The config a run was started with, plus new overrides (``submit --resume RUN``), its LR
    schedule's length as ``train.lr_schedule_on_resume`` says (``resumed_config``)."""
    paths = RunPaths(run)
    if not paths.config.exists():
        raise UserInputError(f"{run} is not an hpclaunch run (no config.yaml)", where="--resume")
    refuse_moving_a_resume(run, overrides)
    return resumed_config(paths, overrides)


def refuse_moving_a_resume(run: Path, overrides: list[str]) -> None:
    """A resume continues RUN where it is (its run_dir, read from where it lies now): a ``--set
    run_dir`` elsewhere would start the run's config afresh there."""
    sets = [o.partition("=") for o in overrides]
    there = [value.strip().strip("'\"") for key, _, value in sets if key.strip() == "run_dir"]
    if any(Path(value).expanduser().resolve() != run.resolve() for value in there):
        raise UserInputError(
            f"--resume {run} continues the run in its own directory: run_dir cannot be set with it",
            where="--set run_dir",
            hint="leave out --set run_dir (move the run directory itself if it must live elsewhere)",
        )


def resumed_config(paths: RunPaths, overrides: list[str]) -> RunConfig:
    """``RUN/config.yaml`` plus ``overrides``; where they change ``train.steps``, the schedule keeps
    its length (pinned, ``keep``) or is fitted to the new one (``stretch``): ``lr_schedule``."""
    from ..lr_schedule import pinned_length

    new = read_config(paths, overrides)
    pin = pinned_length(read_config(paths).train, new.train, overrides)
    return new if pin is None else read_config(paths, [*overrides, pin])


def resume_change(paths: RunPaths, cfg: RunConfig, *, step: int) -> ResumeChange | None:
    """What resuming the run at ``paths`` with ``cfg`` from ``step`` changes of its LR schedule or
    global batch (None: nothing), against the config it has recorded."""
    from ..lr_schedule import resume_change as change

    if not paths.config.exists():
        return None
    return change(read_config(paths), cfg, step=step)
