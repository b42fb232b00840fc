"""Is the writer process starved of CPU? Read from the kernel's run-queue accounting.

An idle-priority writer (``checkpoint.writer_idle``, SCHED_IDLE) runs only on CPU time nothing else
wants. On a node whose cores all train, the rank's own waits leave it enough; on a node where other
processes also keep every core busy (data loader workers, another job, a loaded CI machine) it can
wait almost forever, and a rank that must wait for its save (the next save, the stop save) would
wait with it. An unprivileged process cannot raise its priority again (RLIMIT_NICE is 0 almost
everywhere), so the remedy is a new writer at ``writer_nice`` (``background.ProcessBackground``).

What tells starvation from a slow disk: ``/proc/PID/task/*/schedstat`` counts, per thread, the
nanoseconds spent runnable but waiting for a CPU. A writer waiting on I/O is not runnable and does
not count; a starved one accumulates run-queue time at about the wall clock's pace.
"""

from __future__ import annotations

import time
from collections import deque
from pathlib import Path

PATIENCE_S = 2.0  # how long a rank waits on a starved writer before replacing it
STARVED_SHARE = 0.5  # run-queue time over wall time, summed over the writer's threads


def run_queue_seconds(pid: int) -> float | None:
    """Seconds the threads of ``pid`` have spent runnable but not running (None: cannot tell)."""
    total = 0
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                total += int((task / "schedstat").read_text().split()[1])
            except (OSError, IndexError, ValueError):
                continue  # a thread that just ended
    except OSError:
        return None
    return total / 1e9


class StarvationWatch:
    """Samples a process's run-queue time while a rank waits for it; ``starved()`` once the process
    spent at least ``share`` of the last ``patience_s`` seconds waiting for a CPU."""

    def __init__(self, pid: int, *, patience_s: float = PATIENCE_S, share: float = STARVED_SHARE) -> None:
        self.pid = pid
        self.patience_s = patience_s
        self.share = share
        self._samples: deque[tuple[float, float]] = deque()
        self.last_share: float | None = None
        self.starved_share: float | None = None  # the share when starved() last said yes

    def starved(self, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        queued = run_queue_seconds(self.pid)
        if queued is None:
            return False
        self._samples.append((now, queued))
        # keep the newest sample at least patience_s old as the window's start
        while len(self._samples) > 2 and now - self._samples[1][0] >= self.patience_s:
            self._samples.popleft()
        start, start_queued = self._samples[0]
        if now - start < self.patience_s:
            return False
        self.last_share = (queued - start_queued) / (now - start)
        if self.last_share < self.share:
            return False
        self.starved_share = round(self.last_share, 2)
        return True
