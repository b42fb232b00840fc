"""How long a rank took to start, phase by phase: the ``resumed`` event carries it.

Contract (read by goodput accounting): rank 0's ``resumed`` ledger event has
``process_start`` (epoch seconds this rank's process started, from the OS) and ``startup_s`` =
``{"imports", "distributed", "smoke", "data", "model", "load"}``, durations in seconds in that
order: interpreter start to the trainer's ``main`` (imports of torch, mmdit, hpclaunch), joining
the process group, the distributed smoke test, data validation and loader set-up, building and
wrapping the model and optimizer, loading the checkpoint. A phase that did not happen is 0.
"""

from __future__ import annotations

import os
import time

PHASES = ("imports", "distributed", "smoke", "data", "model", "load")


def process_start_time() -> float:
    """Epoch seconds at which this process started (psutil reads it from the OS)."""
    try:
        import psutil

        return float(psutil.Process(os.getpid()).create_time())
    except Exception:  # pragma: no cover - psutil is a dependency; never fail a run for a figure
        return time.time()


class StartupClock:
    """Marks the end of each start-up phase; ``seconds()`` is the ``startup_s`` table."""

    def __init__(self, *, imports_s: float = 0.0, process_start: float | None = None):
        self.process_start = process_start if process_start is not None else process_start_time()
        self.durations = dict.fromkeys(PHASES, 0.0)
        self.durations["imports"] = max(0.0, imports_s)
        self._last = time.monotonic()

    def begin(self) -> None:
        """Start timing from now (the first phase after imports begins)."""
        self._last = time.monotonic()

    def mark(self, phase: str) -> None:
        """``phase`` ends now; it lasted since the previous mark (or ``begin``)."""
        now = time.monotonic()
        self.durations[phase] += now - self._last
        self._last = now

    def seconds(self) -> dict[str, float]:
        return {k: round(self.durations[k], 3) for k in PHASES}

    @classmethod
    def since_process_start(cls) -> StartupClock:
        """A clock whose ``imports`` phase is the time from the process's start until now."""
        start = process_start_time()
        return cls(imports_s=time.time() - start, process_start=start)
