"""``hpclaunch preflight``: the login-node health check as a table (or JSON for scripts)."""

from __future__ import annotations

from typing import Annotated

import typer

from ..errors import PreflightFailed
from .common import ConfigArg, JsonOpt, SetOpt, console, load, print_json

ONLY_HELP = "Run only these checks (comma-separated): env, gpu, data, disk, network, scheduler, config."


def register(app: typer.Typer) -> None:
    app.command("preflight")(preflight)


def preflight(
    config: ConfigArg,
    overrides: SetOpt = None,
    as_json: JsonOpt = False,
    only: Annotated[str | None, typer.Option("--only", help=ONLY_HELP, metavar="NAME,...")] = None,
) -> None:
    """Check in seconds whether the run can work: environment, GPUs, data, disk, network, scheduler.

    Exit code 0 when nothing fails (warnings allowed), 1 when a check fails, 2 on bad input.
    The same node-level checks run again on every allocated node before torchrun starts.

    Examples:
      hpclaunch preflight examples/tiny.yaml
      hpclaunch preflight run.yaml --only data,disk --json
    """
    from ..preflight import print_report, run_login_checks

    names = None if only is None else {n.strip() for n in only.split(",")}
    cfg = load(config, overrides)
    report = run_login_checks(cfg, only=names)
    if as_json:
        print_json(report.to_json())
    else:
        print_report(report, console=console)
    if report.failed:
        names_failed = ", ".join(c.name for c in report.failed)
        first = report.failed[0]
        raise PreflightFailed(
            f"{len(report.failed)} check(s) failed: {names_failed}",
            where="preflight",
            hint=first.hint or f"see the {first.name} finding above",
        )
