"""``hpclaunch preflight``: the login-node health check as a table (or JSON for scripts)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

import typer

from ..errors import PreflightFailed
from .common import ConfigOptArg, JsonOpt, ScriptOpt, SetOpt, console, load_run_config, print_json

if TYPE_CHECKING:  # imported where used, not here: the CLI starts without them
    from ..estimate import Estimate
    from ..preflight.run_estimate import CannotEstimate
    from ..probe_shapes import StepMeasure

# The login checks (preflight.runner.LOGIN_CHECKS, which a test holds this to): written out, since
# importing the runner here would load every check for any command's --help.
ONLY_HELP = (
    "Run only these checks (comma-separated): env, gpu, data, disk, network, scheduler, config, fds, "
    "container, script."
)


def register(app: typer.Typer) -> None:
    app.command("preflight")(preflight)


def preflight(
    config: ConfigOptArg = None,
    overrides: SetOpt = None,
    script: ScriptOpt = None,
    as_json: JsonOpt = False,
    only: Annotated[str | None, typer.Option("--only", help=ONLY_HELP, metavar="NAME,...")] = None,
    no_estimate: Annotated[
        bool,
        typer.Option(
            "--no-estimate", help="Skip the ETA and cost estimate (it runs a few steps of one rank)."
        ),
    ] = False,
) -> None:
    """Check in seconds whether the run can work: environment, GPUs, data, disk, network, scheduler.

    Exit code 0 when nothing fails (warnings allowed), 1 when a check fails, 2 on bad input.
    The same node-level checks run again on every allocated node before the ranks start.

    Examples:
      hpclaunch preflight examples/tiny.yaml
      hpclaunch preflight run.yaml --only data,disk --json
      hpclaunch preflight base.yaml exp.yaml --set scheduler.gpu_hour_cost=2.5
      hpclaunch preflight --script train.py cluster.yaml
    """
    from ..preflight import print_report, run_login_checks

    names = None if only is None else {n.strip() for n in only.split(",")}
    cfg = load_run_config(config, overrides, script, command="preflight")
    from ..orchestrator.refusals import refuse_bad_init_from

    refuse_bad_init_from(cfg, cfg.run_path(), pending_ok=True)
    # The estimate's steps run in the probe, started before the checks and timing them beside
    # the checks, after its own answer (one torch import for both); closed here whatever happens.
    probe = None if no_estimate or only is not None else _start_probe(cfg)
    try:
        report = run_login_checks(cfg, only=names, probe=probe)
        estimated = None if probe is None else _estimate(cfg, probe)
    finally:
        if probe is not None:
            probe.close()
    if as_json:
        est = estimated if estimated is None or isinstance(estimated, dict) else estimated.to_json()
        print_json({**report.to_json(), **({"estimate": est} if est is not None else {})})
    else:
        print_report(report, console=console)
        if estimated is not None:
            _print_estimate(estimated)
    if report.failed:
        names_failed = ", ".join(c.name for c in report.failed)
        first = report.failed[0]
        raise PreflightFailed(
            f"{len(report.failed)} check(s) failed: {names_failed}",
            where="preflight",
            hint=first.hint or f"see the {first.name} finding above",
        )


def _start_probe(cfg: Any) -> Any:
    """The checks' probe, asked to time the estimate's steps once it has answered them."""
    from ..preflight.container_check import job_probe
    from ..preflight.run_estimate import step_env, step_request
    from ..preflight.runner import PROBE_TIMEOUT_S

    return job_probe(cfg, timeout_s=PROBE_TIMEOUT_S, estimate=step_request(cfg), env=step_env(cfg))


def _estimate(cfg: Any, probe: Any) -> Estimate | CannotEstimate:
    from ..preflight.run_estimate import TIMEOUT_S, preflight_estimate

    step: StepMeasure = probe.step_estimate(TIMEOUT_S)
    if probe.python is None:
        step = {"error": f"the job's Python ({cfg.launch.python}) is not on this machine"}
    return preflight_estimate(cfg, step=step)


def _print_estimate(est: Estimate | CannotEstimate) -> None:
    from ..orchestrator.accounting import fmt_seconds
    from ..orchestrator.cost import describe

    if isinstance(est, dict):  # CannotEstimate
        console.print(f"estimate: {est['reason']}", highlight=False)
        return
    console.print(
        f"estimate: {est.seconds_per_step or 0.0:.3f} s/step x {est.steps_left} steps = "
        f"{fmt_seconds(est.training_left_s)} of training; {describe(est)}",
        highlight=False,
    )
    for note in est.notes:
        console.print(f"  {note}", highlight=False)
