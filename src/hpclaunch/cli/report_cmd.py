"""``hpclaunch report RUN [-o DIR]``: figures and one HTML page of a run or a sweep."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def register(app: typer.Typer) -> None:
    app.command("report")(report)


def report(
    run: Annotated[
        Path, typer.Argument(help="The run directory (runs/<name>) or a sweep's root.", metavar="RUN")
    ],
    out: Annotated[
        Path | None,
        typer.Option(
            "-o", "--out", "--output", help="Where to write the report (default RUN/report).", metavar="DIR"
        ),
    ] = None,
) -> None:
    """Loss with every stop marked, where the wall-clock time went, throughput: PNGs + one HTML page.

    Works on a running run, a finished one, and a sweep (its points compared in one figure).

    Examples:
      hpclaunch report runs/tiny
      hpclaunch report runs/tiny -o /tmp/tiny-report
    """
    from ..orchestrator.report import build_report
    from .run_dirs import run_paths
    from .views import scheduler_status

    paths = run_paths(run)
    result = build_report(paths.root, out, scheduler_status=scheduler_status(paths))
    # plain lines: paths must not be wrapped (scripts and terminals copy them)
    typer.echo(f"report: {result.page}")
    for fig in result.figures:
        typer.echo(f"  {fig}")
    for point in result.points:
        typer.echo(f"  point {point.directory.name}: {point.page} ({len(point.figures)} figures)")
    for note in result.notes:
        typer.echo(f"  note: {note}")
