"""``hpclaunch stop | cancel RUN``: end a run gracefully (a checkpoint at one step) or at once.

Both take a run, a sweep's point or a sweep's root (every point still in flight), and both refuse a
run that has ended the same way: one line naming its state, exit 2, nothing written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ..errors import RunStateError, UserInputError
from ..orchestrator.status import StatusView
from ..rundir import CANCELLED, STOP_REQUESTED, Ledger, RunPaths, read_events
from ..rundir.cause import Cause
from ..templates.shell import quote
from .common import console
from .run_dirs import found
from .views import plan_scheduler, status_view

RunArg = Annotated[
    Path, typer.Argument(help="The run directory (runs/<name>) or a sweep's root.", metavar="RUN")
]


# States in which a job still runs but its ranks will never read a stop: its attempt decided (a
# stop saved, all steps done, a failure) or the run cancelled. A stop there would be left, unread.
_PAST_STOPPING = ("stopping", "finishing", "failing", "cancelling", "cancelled")


def _stoppable(view: StatusView) -> bool:
    """A stop can still change what the run does. An attempt stopping for the scheduler (its time
    limit's warning, a preemption) is continued, so a stop then is the decider's to take, or the
    next attempt's (``rundir.control``): the run ends instead of going on. Only a stop of the
    user's own is past stopping."""
    if not view.in_flight:
        return False
    if view.state == "stopping":
        return bool(view.attempts) and view.attempts[-1].cause not in (None, Cause.USER.value)
    return view.state not in _PAST_STOPPING


def _in_flight(run: Path, command: str) -> tuple[Path, list[RunPaths], int]:
    """The run's root, the runs (a sweep's points) still in flight (for ``stop``: that can still
    stop), and how many points there are; RunStateError when none is (the run, or every point, has
    ended)."""
    there = found(run)
    views: dict[RunPaths, StatusView] = {
        p: status_view(p) for p in [RunPaths(p) for p in there.points] or [RunPaths(there.path)]
    }
    wanted = _stoppable if command == "stop" else (lambda view: view.in_flight)
    targets = [p for p, view in views.items() if wanted(view)]
    if not targets:
        states = ", ".join(sorted({view.state for view in views.values()}))
        what = "every point of the sweep has" if there.points else "the run has"
        raise RunStateError(
            f"nothing to {command}: {what} ended ({states}); nothing was written",
            where=str(there.path),
            hint=f"see hpclaunch status {quote(there.path)}; continue a stopped run with "
            "hpclaunch submit --resume",
        )
    return there.path, targets, len(there.points)


def stop(
    run: RunArg,
    continue_: Annotated[
        bool,
        typer.Option(
            "--continue", help="After the save, continue automatically (requeue) instead of ending."
        ),
    ] = False,
) -> None:
    """Stop a running run gracefully: every rank stops at the same step and saves a checkpoint.

    Continue later with 'hpclaunch submit --resume RUN' (a foreground run: the same 'hpclaunch train'
    command with --resume), or at once with --continue. A sweep's root: every point still running.

    Example: hpclaunch stop runs/tiny
    """
    from ..orchestrator.status import running_attempt
    from ..rundir.control import drop_user_stop, write_user_stop

    root, targets, points = _in_flight(run, "stop")
    attempts = {}
    for target in targets:
        attempts[target] = running_attempt(read_events(target).events)
        write_user_stop(target, continue_=continue_, attempt=attempts[target], by="hpclaunch stop")
    # A run can end between the look above and its request landing (its last step already done):
    # nothing would read the request. Looked at again once it is there, such a request is taken back.
    late = {t: view.state for t in targets if not _stoppable(view := status_view(t))}
    for target in late:
        drop_user_stop(target)
    targets = [t for t in targets if t not in late]
    if not targets:
        states = ", ".join(sorted(set(late.values())))
        raise RunStateError(
            f"nothing to stop: the run ended ({states}) before the stop reached it; nothing was left behind",
            where=str(root),
            hint=f"see hpclaunch status {quote(root)}",
        )
    for target in targets:
        Ledger(target, role="cli").append(
            STOP_REQUESTED,
            cause=Cause.USER,
            source="hpclaunch stop",
            continue_=continue_,
            attempt_seen=attempts[target],
        )
    what = f"{len(targets)} of the {points} points of sweep {root}" if points else str(root)
    console.print(f"stop requested for {what}: all ranks will save at the next check", highlight=False)


def cancel(run: RunArg) -> None:
    """Cancel the run's job at once (scancel / qdel / local kill); no checkpoint is guaranteed.

    A sweep's root: every point still pending or running.

    Example: hpclaunch cancel runs/tiny
    """
    _, targets, _ = _in_flight(run, "cancel")
    for target in targets:
        _cancel_job(target)


def _cancel_job(paths: RunPaths) -> None:
    from ..orchestrator.status import current_job_id
    from ..schedulers.chain_release import settle_followers
    from ..schedulers.registry import get_scheduler
    from ..schedulers.rescue_job import withdraw_rescues

    job_id = current_job_id(read_events(paths).events)
    kind = plan_scheduler(paths)
    if not job_id or not kind:
        raise UserInputError("this run has no submitted job", where=str(paths.root))
    # Recorded first: the agent reads it to tell this cancellation from a preemption.
    Ledger(paths, role="cli").append(CANCELLED, job_id=job_id, by="hpclaunch cancel")
    # Its rescue first: a cancelled job ends "not ok", which would start it (to do nothing).
    withdraw_rescues(paths, get_scheduler(kind), role="cli")
    get_scheduler(kind).cancel(paths, job_id)
    console.print(f"cancelled job {job_id} ({paths.root.name})", highlight=False)
    for follower, _ in settle_followers(paths, by="hpclaunch cancel"):
        console.print(f"cancelled {follower.run} (chained after this run)", highlight=False)
