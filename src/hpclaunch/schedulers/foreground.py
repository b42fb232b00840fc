"""A foreground ``hpclaunch train``: the job is the ``train`` process itself, with no controller.

Its job id is ``fg<pid of train>``; the node agent runs inside that process and holds the run lock
under that id (``rundir.lock``: role ``train``, then ``agent``, with a heartbeat) until it has decided
the attempt. So the lock is the scheduler's answer: held by that job and alive -> running; released
or taken by another job -> ended (the ledger says how); held by that job and dead -> the process
died without deciding (the run is lost, and ``status`` says so).
"""

from __future__ import annotations

import contextlib
import os
import signal

from ..errors import SchedulerError
from ..rundir import RunLock, RunPaths
from ..rundir.lock import liveness, process_start
from .protocol import JobState, SchedulerStatus

PREFIX = "fg"


def job_id(pid: int | None = None) -> str:
    """The job id of the foreground run of process ``pid`` (this process by default)."""
    return f"{PREFIX}{os.getpid() if pid is None else pid}"


def is_foreground(job: str) -> bool:
    return job.startswith(PREFIX) and job[len(PREFIX) :].isdigit()


def status(paths: RunPaths, job: str) -> SchedulerStatus:
    holder = RunLock(paths).read()
    if holder is None or holder.job_id != job:
        return SchedulerStatus(JobState.COMPLETED, "ended", "the foreground train has ended")
    live = liveness(holder, is_active=None)
    if live.alive:
        return SchedulerStatus(
            JobState.RUNNING, "foreground", f"hpclaunch train on {holder.host} ({live.why})"
        )
    return SchedulerStatus(
        JobState.FAILED, "gone", f"the foreground train died without deciding its attempt ({live.why})"
    )


def cancel(paths: RunPaths, job: str) -> None:
    """SIGTERM to the ``train`` process, as ``scancel`` sends it: its agent reads the ``cancelled``
    event written first and ends the run. Only from the host it runs on (a pid means nothing elsewhere)."""
    holder = RunLock(paths).read()
    if holder is None or holder.job_id != job or not liveness(holder, is_active=None).alive:
        raise SchedulerError(f"the foreground train {job} is not running", where="cancel")
    if holder.pid <= 0 or holder.host != _this_host():
        raise SchedulerError(
            f"the foreground train {job} runs on {holder.host}: cancel it there (Ctrl-C, or this command)",
            where="cancel",
        )
    # Signalled through a pidfd, opened first and then checked to be the process that took the lock
    # (its start time): a pid the train process left behind may name another process by now.
    try:
        fd = os.pidfd_open(holder.pid)
    except ProcessLookupError:
        return
    try:
        if holder.pid_start and process_start(holder.pid) != holder.pid_start:
            raise SchedulerError(
                f"the foreground train {job} is not running (its pid {holder.pid} is another process now)",
                where="cancel",
            )
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(fd, signal.SIGTERM)
    finally:
        os.close(fd)


def _this_host() -> str:
    import socket

    return socket.gethostname().split(".")[0]
