"""What a hang leaves behind on one node, and how its workers are stopped: every rank's Python stacks
(faulthandler on ``STACK_SIGNAL``, in C: it works while the main thread is stuck), NCCL's flight
record (a write to torch's dump pipe), then SIGKILL for the workers and what they started.
``watchdog`` calls these on a verdict; the agent stops a node's workers the same way when another
node ended the attempt."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Mapping
from pathlib import Path

from ..rundir import RunPaths
from ..rundir.progress_files import (
    NCCL_PIPE_STEM,
    NCCL_TRACE_STEM,
    STACK_SIGNAL,
    nccl_dump_dir,
    read_progress,
    stacks_file,
)


def dump_stacks(
    paths: RunPaths,
    attempt: str,
    pids: list[int],
    why: str,
    *,
    wait_s: float,
    ranks_by_pid: Mapping[int, int] | None = None,
) -> list[int]:
    """Ask this node's workers for every thread's stack; the ranks whose dump arrived in ``wait_s``.
    ``ranks_by_pid``: which rank each pid is (from this node's progress records)."""
    asked: dict[int, tuple[Path, int]] = {}
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    by_pid = ranks_by_pid
    if by_pid is None:
        by_pid = {rec.pid: rank for rank, rec in read_progress(paths, attempt).items() if rec.pid}
    for pid in pids:
        rank = by_pid[pid] if pid in by_pid else _rank_of(pid)
        if rank is None:
            continue
        path = stacks_file(paths, attempt, rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.write(
                f"# hpclaunch watchdog {stamp}: {why}\n# rank {rank}, pid {pid}: most recent call first\n"
            )
        asked[rank] = (path, file_size(path))
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, STACK_SIGNAL)
    deadline = time.time() + wait_s
    pending = dict(asked)
    while pending and time.time() < deadline:
        pending = {r: (p, n) for r, (p, n) in pending.items() if file_size(p) <= n}
        time.sleep(0.05)
    time.sleep(0.2)  # faulthandler writes thread after thread
    return sorted(r for r in asked if r not in pending)


def flight_recorder_env(paths: RunPaths, attempt: str) -> dict[str, str]:
    """The NCCL flight recorder's variables, dumping into this attempt's log directory."""
    from ..nccl import flight_recorder_env as variables

    where = nccl_dump_dir(paths, attempt)
    where.mkdir(parents=True, exist_ok=True)
    return variables(str(where / NCCL_TRACE_STEM), str(where / NCCL_PIPE_STEM))


def trigger_flight_recorder(paths: RunPaths, attempt: str, ranks: list[int], wait_s: float) -> list[str]:
    """Make this node's NCCL ranks dump their flight record (torch's dump pipe); the files that came."""
    directory = nccl_dump_dir(paths, attempt)
    for rank in ranks:
        pipe = directory / f"{NCCL_PIPE_STEM}{rank}.pipe"
        with contextlib.suppress(OSError):  # no pipe: NCCL never started on this rank
            fd = os.open(pipe, os.O_WRONLY | os.O_NONBLOCK)
            try:
                os.write(fd, b"1")
            finally:
                os.close(fd)
    wanted = [directory / f"{NCCL_TRACE_STEM}{rank}" for rank in ranks]
    deadline = time.time() + wait_s
    while time.time() < deadline and not all(p.exists() for p in wanted):
        time.sleep(0.1)
    return [str(p.relative_to(paths.root)) for p in wanted if p.exists()]


def stop_workers(pids: list[int]) -> None:
    """SIGKILL the workers (and anything they started): a hung rank cannot save or exit by itself."""
    import psutil

    for pid in pids:
        try:
            proc = psutil.Process(pid)
            family = [*proc.children(recursive=True), proc]
        except psutil.NoSuchProcess:
            continue
        for p in family:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.send_signal(signal.SIGKILL)


def _rank_of(pid: int) -> int | None:
    """A rank's number from the environment it was exec'd with (``RANK``). Ranks forked by the
    rank host are found by the pid their heartbeat names instead."""
    import psutil

    try:
        value = psutil.Process(pid).environ().get("RANK")
    except (psutil.Error, OSError):
        return None
    return int(value) if value is not None and value.isdigit() else None


def file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0
