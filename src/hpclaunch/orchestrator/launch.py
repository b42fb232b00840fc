"""Login-node flow: config -> plan -> script -> (preflight) -> run directory -> submit.

``render`` and ``submit`` share this code path, so what ``hpclaunch render`` prints is byte for byte
what ``submit`` hands to the scheduler. Nothing is written before every check has passed: a bad
input leaves no half-made run directory behind.
"""

from __future__ import annotations

import itertools
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ..config import RunConfig, apply_override, validate_config
from ..errors import UserInputError
from ..fsutil import atomic_write_json, atomic_write_text
from . import plan as plan_mod
from . import runs
from .plan import JobPlan, SweepPoint
from .runs import Ledger, RunPaths
from .schedulers.base import RenderedJob, get_scheduler


@dataclass
class Prepared:
    cfg: RunConfig
    plan: JobPlan
    rendered: RenderedJob
    point_cfgs: list[RunConfig] = field(default_factory=list)  # one per sweep point


def with_scheduler(cfg: RunConfig, kind: str | None, dialect: str | None) -> RunConfig:
    """``render --scheduler/--pbs-dialect`` as if they were config overrides (validated the same way)."""
    if kind is None and dialect is None:
        return cfg
    raw = cfg.to_dict()
    if kind is not None:
        apply_override(raw, f"scheduler.kind={kind}")
    if dialect is not None:
        apply_override(raw, f"scheduler.pbs_dialect={dialect}")
    return validate_config(raw, where="--scheduler")


def nccl_plan_env(cfg: RunConfig) -> dict[str, str]:
    """Variables of an explicitly named preset + the user's; ``auto`` is resolved on each node."""
    from ..jobs.nccl import static_preset_env

    env: dict[str, str] = {}
    if cfg.backend == "nccl":
        # Never detect on the login node: its fabric is not the compute nodes'.
        env.update(static_preset_env(cfg.nccl.preset))
    env.update(cfg.nccl.env)
    return env


def expand_sweep(cfg: RunConfig, sweeps: list[str]) -> list[tuple[str, list[str], RunConfig]]:
    """``k=a,b`` x ``j=c,d`` -> the cartesian product: (point name, overrides, config) each."""
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
        axes.append([f"{key.strip()}={v.strip()}" for v in values.split(",") if v.strip()])
    points = []
    root = cfg.run_path()
    for index, combo in enumerate(itertools.product(*axes)):
        raw = cfg.to_dict()
        for override in combo:
            apply_override(raw, override)
        label = "-".join(o.split("=", 1)[0].rsplit(".", 1)[-1] + o.split("=", 1)[1] for o in combo)
        name = f"p{index}-{label}"[:60].replace("/", "_")
        raw["run_dir"] = str(root / name)
        raw["name"] = _safe_name(f"{cfg.name}-{name}")
        points.append((name, list(combo), validate_config(raw, where=f"--sweep point {index}")))
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
        rendered = get_scheduler(cfg.scheduler.kind).render(plan)
        return Prepared(cfg, plan, rendered, [c for _, _, c in points])
    plan = plan_mod.build(cfg, python=python, nccl_env=nccl_plan_env(cfg))
    rendered = get_scheduler(cfg.scheduler.kind).render(plan)
    return Prepared(cfg, plan, rendered)


def _check_new_run_dir(root: Path) -> None:
    if RunPaths(root).is_run():
        raise UserInputError(
            f"a run already exists in {root}",
            where="run_dir",
            hint=f"continue it with 'hpclaunch submit --resume {root}', or choose another name/run_dir",
        )


def write_run_dir(cfg: RunConfig, plan: JobPlan, rendered: RenderedJob | None) -> RunPaths:
    """config.yaml (what actually runs), plan.json and the job script."""
    paths = RunPaths(Path(plan.run_dir), Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else None).ensure()
    atomic_write_text(paths.config, cfg.to_yaml())
    atomic_write_json(paths.plan, plan.model_dump(mode="json"))
    if rendered is not None:
        atomic_write_text(paths.root / rendered.filename, rendered.text, mode=0o755)
    return paths


def submit(prepared: Prepared, *, run_preflight: bool = True, resume: bool = False) -> tuple[RunPaths, str]:
    """Write the run directory (one per sweep point) and hand the rendered script to the scheduler."""
    plan, cfg, rendered = prepared.plan, prepared.cfg, prepared.rendered
    scheduler = get_scheduler(plan.scheduler)
    if not resume:
        for root in [Path(plan.run_dir), *(Path(p.run_dir) for p in plan.sweep)]:
            _check_new_run_dir(root)
    paths = write_run_dir(cfg, plan, rendered)
    points = []
    for point_cfg in prepared.point_cfgs:
        # Each point has its own plan and a plain (non-array) script: continuation jobs submit it.
        point_plan = plan_mod.build(point_cfg, python=plan.python, nccl_env=nccl_plan_env(point_cfg))
        point_script = scheduler.render(point_plan)
        points.append((write_run_dir(point_cfg, point_plan, point_script), point_plan, point_script))

    if not plan.sweep:
        job_id = scheduler.submit(plan, rendered)
        targets = [(paths, job_id)]
    elif plan.scheduler == "local":  # no arrays here: one controller per point
        targets = [(p, scheduler.submit(pp, ps)) for p, pp, ps in points]
        job_id = ",".join(j for _, j in targets)
    else:
        job_id = scheduler.submit(plan, rendered)
        task = "{}_{}" if plan.scheduler == "slurm" else "{}[{}]"
        targets = [(p, task.format(job_id, i)) for i, (p, _, _) in enumerate(points)]
    if plan.sweep:
        atomic_write_json(
            paths.root / "sweep.json", {"job_id": job_id, "points": [p.model_dump() for p in plan.sweep]}
        )
    for target, target_job in targets:
        ledger = Ledger(target.events)
        if not run_preflight:
            ledger.append(runs.PREFLIGHT_SKIPPED, by="--no-preflight")
        ledger.append(
            runs.SUBMITTED,
            job_id=target_job,
            scheduler=plan.scheduler,
            script=rendered.filename,
            resume=resume,
            world_size=plan.world_size,
            preflight="passed" if run_preflight else "skipped",
        )
    return paths, job_id


def load_existing_run(run: Path, overrides: list[str]) -> RunConfig:
    """The config a run was started with, plus new overrides (``submit --resume RUN``)."""
    paths = RunPaths(run)
    if not paths.config.exists():
        raise UserInputError(f"{run} is not a hpclaunch run (no config.yaml)", where="--resume")
    raw = yaml.safe_load(paths.config.read_text()) or {}
    for item in overrides:
        apply_override(raw, item)
    return validate_config(raw, where=str(paths.config))
