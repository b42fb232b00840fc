"""A run directory named on the command line: what is there, and the refusals that follow from it.

Every command that takes RUN asks ``found`` first; one that cannot apply to what it found (no run,
a sweep's root where one run is needed, a run that has finished or is still exiting) says what it
found in one line, exit 2, nothing written. A ``--resume`` never changes what a directory holds:
a run stays a run, a sweep's root a sweep, a point a point. (What ``submit`` and ``train`` refuse of
the run they would write or continue is the login flow's: ``orchestrator/login_flow.py``.)
"""

from __future__ import annotations

from pathlib import Path

from ..errors import RunNotFoundError, RunStateError
from ..rundir import RunPaths
from ..rundir.readers import Found, RunKind, what_is_at
from ..templates.shell import quote


def found(run: Path) -> Found:
    """What is at ``run``; RunNotFoundError (saying what is there instead) when it is no run."""
    there = what_is_at(run)
    if there.kind is RunKind.NONE:
        raise RunNotFoundError(there.describe(), where="RUN", hint="see runs/ for your runs")
    return there


def run_paths(run: Path) -> RunPaths:
    return RunPaths(found(run).path)


def one_run(run: Path, command: str) -> RunPaths:
    """A run or a sweep's point; a sweep's root is refused, naming a point to use instead."""
    there = found(run)
    if there.kind is RunKind.SWEEP:
        raise RunStateError(
            f"{there.describe()}: {command} takes one run",
            where="RUN",
            hint=f"name one of its points: hpclaunch {command} {quote(there.points[0])}",
        )
    return RunPaths(there.path)


def refuse_sweep_with_resume(resume: Path | None, sweeps: list[str] | None) -> None:
    """``--sweep`` makes a new sweep; with ``--resume`` it would turn RUN into another kind of run."""
    if resume is None or not sweeps:
        return
    raise RunStateError(
        f"--sweep starts a new sweep and --resume continues what {resume} holds; "
        "a resume never turns a run into a sweep; nothing was written",
        where="--sweep",
        hint=f"resume it without --sweep (hpclaunch submit --resume {quote(resume)}), or submit the sweep "
        "as a new run: hpclaunch submit CONFIG --sweep KEY=V1,V2 --set name=NEW",
    )


def resumable(run: Path) -> RunPaths:
    """``submit --resume RUN``: a run or a sweep's point; a sweep's root trains nothing itself."""
    there = found(run)
    if there.kind is RunKind.SWEEP:
        raise RunStateError(
            f"{there.describe()}; its root trains nothing itself, so there is nothing in it to resume; "
            "nothing was written",
            where="--resume",
            hint="resume each point from its own checkpoint: "
            + "; ".join(f"hpclaunch submit --resume {quote(p)}" for p in there.points[:2])
            + ("; ..." if len(there.points) > 2 else ""),
        )
    return RunPaths(there.path)
