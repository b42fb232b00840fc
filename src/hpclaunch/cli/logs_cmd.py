"""``hpclaunch logs RUN``: every attempt's node log in order, each headed by how that attempt ended
(``--attempt N``: one; ``-f``: follow the run to its end, moving on after a requeue)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer

from ..errors import UserInputError
from ..orchestrator.status import Attempt, attempts_from_events
from ..rundir import RunPaths, read_events
from .common import err_console
from .follow import attempt_log_dirs, copy_out, follow_logs
from .run_dirs import one_run
from .views import busy, ended_code, status_view


def logs(
    run: Annotated[Path, typer.Argument(help="The run directory (runs/<name>).", metavar="RUN")],
    follow: Annotated[
        bool,
        typer.Option(
            "-f",
            "--follow",
            help="Keep printing as the log grows, move on to the next attempt when the run is requeued, "
            "stop when the run ends (exit 1 if it failed).",
        ),
    ] = False,
    attempt: Annotated[
        int | None, typer.Option("--attempt", help="Only this attempt (1 = first; default: every attempt).")
    ] = None,
    node: Annotated[int, typer.Option("--node", help="Node rank.")] = 0,
) -> None:
    """Print one node's log of every attempt (the node agent, its rank host and all ranks' output),
    each headed by how the attempt ended.

    Examples:
      hpclaunch logs runs/tiny
      hpclaunch logs runs/tiny --attempt 1
      hpclaunch logs runs/tiny -f
    """
    paths = one_run(run, "logs")
    dirs = attempt_log_dirs(paths)
    if not dirs and follow:
        err_console.print("waiting for the job to start ...", highlight=False)
        while not dirs and busy([status_view(paths)]):
            time.sleep(1.0)
            dirs = attempt_log_dirs(paths)
    if not dirs:
        raise UserInputError("no logs yet (the job has not started)", where=str(paths.logs))
    if attempt is not None and not 1 <= attempt <= len(dirs):
        raise UserInputError(f"attempt {attempt} does not exist (1..{len(dirs)})", where="--attempt")
    if follow:
        index = (attempt or len(dirs)) - 1

        def ended() -> int | None:
            view = status_view(paths)
            return None if busy([view]) else ended_code([view])

        raise typer.Exit(follow_logs(paths, dirs, index, node, pinned=attempt is not None, ended=ended))
    chosen = [attempt - 1] if attempt is not None else list(range(len(dirs)))
    logs_there = [dirs[i] / f"node{node}.log" for i in chosen]
    if not any(log.exists() for log in logs_there):
        raise UserInputError(f"no log for node {node}", where=str(logs_there[-1]))
    ended_as = _attempt_ends(paths)
    for i, log in zip(chosen, logs_there, strict=True):
        key = dirs[i].name.removeprefix("attempt-")
        typer.echo(f"==> attempt {i + 1} of {len(dirs)} ({key}), node {node}: {ended_as.get(key, '?')} <==")
        if log.exists():
            copy_out(log)
        else:
            typer.echo(f"(no log for node {node} in this attempt)")


def _attempt_ends(paths: RunPaths) -> dict[str, str]:
    """How each attempt ended, in words (the ledger's): "stopped after step 115 (timeout)"."""
    return {a.attempt: _ended_words(a) for a in attempts_from_events(read_events(paths).events)}


def _ended_words(a: Attempt) -> str:
    if a.end == "running":
        return f"running, at step {a.last_step}" if a.last_step is not None else "running"
    step = f" after step {a.last_step}" if a.last_step is not None else ""
    cause = f" ({a.cause})" if a.cause else ""
    error = f": {a.error.strip().splitlines()[0]}" if a.error and a.error.strip() else ""
    return f"{a.end}{step}{cause}{error}"
