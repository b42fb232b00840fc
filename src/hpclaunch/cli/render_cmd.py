"""``hpclaunch render``: the exact script ``submit`` would hand to the scheduler."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from ..errors import UserInputError
from ..fsutil import atomic_write_text
from ..schedulers.protocol import RenderedJob
from ..schedulers.registry import get_scheduler
from .common import ConfigOptArg, ScriptOpt, SetOpt, err_console, load_run_config

if TYPE_CHECKING:
    from ..orchestrator.launch import Prepared


def register(app: typer.Typer) -> None:
    app.command("render")(render)


def render(
    config: ConfigOptArg = None,
    overrides: SetOpt = None,
    script: ScriptOpt = None,
    scheduler: Annotated[
        str | None,
        typer.Option("--scheduler", help="Render for this scheduler instead: local, slurm or pbs."),
    ] = None,
    pbs_dialect: Annotated[
        str | None, typer.Option("--pbs-dialect", help="PBS flavour: pro (select=) or torque (nodes=:ppn=).")
    ] = None,
    sweep: Annotated[
        list[str] | None, typer.Option("--sweep", help="Render the job array for key=v1,v2 (repeatable).")
    ] = None,
    rescue: Annotated[
        bool,
        typer.Option(
            "--rescue",
            help="Print the rescue job's script instead (submitted beside each job, held until it fails).",
        ),
    ] = False,
    output: Annotated[
        Path | None, typer.Option("-o", "--out", "--output", help="Write the script here instead of stdout.")
    ] = None,
) -> None:
    """Print the job script exactly as `hpclaunch submit` would submit it (lint included).

    Examples:
      hpclaunch render examples/slurm-8xh100.yaml
      hpclaunch render examples/tiny.yaml --scheduler pbs --pbs-dialect torque -o job.pbs
      hpclaunch render examples/slurm-8xh100.yaml --rescue
      hpclaunch render --script train.py examples/slurm-8xh100.yaml -- --lr 3e-4
    """
    cfg = load_run_config(
        config, overrides, script, scheduler_flags(scheduler, pbs_dialect), command="render"
    )
    # (imported here: every other command's call, status above all, need not import the launch path)
    from ..orchestrator.launch import prepare

    prepared = prepare(cfg, sweeps=sweep or [])
    if rescue:
        prepared = replace(prepared, rendered=rescue_script(prepared))
    for warning in prepared.rendered.warnings:
        err_console.print(f"[yellow]warning:[/] {warning}", highlight=False)
    if output is not None:
        atomic_write_text(output, prepared.rendered.text, mode=0o755)
        err_console.print(f"wrote {output}", highlight=False)
    else:
        typer.echo(prepared.rendered.text, nl=False)


def scheduler_flags(kind: str | None, dialect: str | None) -> list[tuple[str, str]]:
    """``--scheduler``/``--pbs-dialect`` as config keys, applied before the config is validated: a
    value valid only for the scheduler asked for (scheduler.nodes=2 for SLURM) is never judged
    against the config file's own kind."""
    flags = [(f"scheduler.kind={kind}", "--scheduler")] if kind is not None else []
    return flags + ([(f"scheduler.pbs_dialect={dialect}", "--pbs-dialect")] if dialect is not None else [])


def rescue_script(prepared: Prepared) -> RenderedJob:
    """The rescue job's script, exactly as ``submit`` hands it over (``schedulers.rescue_job``)."""
    scheduler = get_scheduler(prepared.plan.scheduler)
    render_rescue = getattr(scheduler, "render_rescue", None)
    if render_rescue is None or prepared.plan.sweep:
        raise UserInputError(
            f"a {prepared.plan.scheduler} {'sweep' if prepared.plan.sweep else 'job'} has no rescue job",
            where="--rescue",
            hint="rescue jobs are left behind single SLURM and PBS jobs",
        )
    if not prepared.plan.rescue.enabled:
        raise UserInputError(
            "this run leaves no rescue job (scheduler.rescue.enabled is false)",
            where="--rescue",
            hint="drop --set scheduler.rescue.enabled=false to see the one it would leave",
        )
    rendered: RenderedJob = render_rescue(prepared.plan)
    return rendered
