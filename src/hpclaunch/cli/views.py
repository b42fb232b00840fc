"""A run's status as the CLI's commands see it: the ledger's story and the scheduler's word on the
current job, read once per look (``status``, ``stop``, ``cancel``, ``logs -f``, the waits)."""

from __future__ import annotations

from typing import Any

from ..errors import SchedulerError
from ..orchestrator.status import StatusView
from ..rundir import RunPaths, read_events, read_plan
from ..templates.shell import quote


def plan_scheduler(paths: RunPaths) -> str | None:
    try:
        return read_plan(paths).scheduler
    except (FileNotFoundError, ValueError):
        return None


def scheduler_status(paths: RunPaths) -> Any:
    from ..orchestrator.status import current_job_id
    from ..schedulers.registry import get_scheduler

    job_id = current_job_id(read_events(paths).events)
    kind = plan_scheduler(paths)
    if not job_id or not kind:
        return None
    try:
        return get_scheduler(kind).status(paths, job_id)
    except SchedulerError:
        return None


def status_view(paths: RunPaths) -> StatusView:
    from ..orchestrator.status import summarize

    return summarize(paths.root, scheduler_status=scheduler_status(paths))


def busy(views: list[StatusView]) -> bool:
    """Some run is mid-flight, still exiting, or its scheduler still holds an active job."""
    return any(v.in_flight for v in views)


def ended_code(views: list[StatusView]) -> int:
    """Once the runs have ended: 1 when one (a sweep point) failed or was lost, else 0 (finished,
    stopped, cancelled: ended as asked). ``submit --wait``, ``status --watch`` and ``logs -f`` alike."""
    return 1 if any(v.state == "failed" or v.state.startswith("lost") for v in views) else 0


def ended_line(view: StatusView) -> str:
    """How a run that did not finish ended, and what to do next, in one line (after a wait); the
    commands in it quoted, to be copied as printed."""
    run = view.run
    arg = quote(run)
    last = view.attempts[-1] if view.attempts else None
    at = f" at step {view.step}" if view.step else ""
    if view.state == "stopped":
        cause = f" ({last.cause})" if last is not None and last.cause else ""
        return f"{run} stopped{at}{cause}, not finished; continue it: hpclaunch submit --resume {arg}"
    if view.state == "failed":
        error = f": {last.error.strip().splitlines()[0]}" if last is not None and last.error else ""
        return f"{run} failed{at}{error}; see hpclaunch logs {arg}"
    if view.state == "cancelled":
        return (
            f"{run} was cancelled{at}; continue it from its last checkpoint: hpclaunch submit --resume {arg}"
        )
    return f"{run} ended {view.state}{at}" + (f"; {view.hint}" if view.hint else "")
