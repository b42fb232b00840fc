"""Every rank's progress, reported without a collective: the step it is on and the phase it is in.

The training loop only sets two attributes (``phase(name)``: a handful of nanoseconds); a daemon
thread writes them to ``RUN/attempts/<attempt>/rank<r>.progress.json`` about once a second, with
the time the phase began. The node agent's watchdog reads these files: a rank whose step and phase
have not changed for longer than the phase's window is stuck, and the phase tells where (a rank
still in ``data`` or ``compute`` while the others wait in ``collective`` is the culprit). The
thread keeps writing while the main thread hangs, so a stale *file* means a dead or frozen process,
a stale *phase* a hang.

Phases: startup, load, data, compute, collective, save, eval, done.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from pathlib import Path

PHASES = ("startup", "load", "data", "compute", "collective", "save", "eval", "done")


class Progress:
    def __init__(self, path: Path | None, *, rank: int, every_s: float = 1.0):
        self.path = path
        self.rank = rank
        self.every_s = every_s
        self.step = 0
        self.current = "startup"
        self.since = time.time()
        self.last_step_s: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._host = socket.gethostname().split(".")[0]

    def start(self) -> Progress:
        if self.path is not None and self._thread is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._write()
            self._thread = threading.Thread(target=self._run, name="hpclaunch-progress", daemon=True)
            self._thread.start()
        return self

    def phase(self, name: str, step: int | None = None) -> None:
        """Enter phase ``name`` (of ``step``, when given). Attribute writes only: safe in the hot loop."""
        if step is not None:
            self.step = step
        if name != self.current:
            self.current = name
            self.since = time.time()

    def stepped(self, step: int, seconds: float) -> None:
        """Step ``step`` is done after ``seconds`` of wall time."""
        self.step = step
        self.last_step_s = seconds

    def close(self) -> None:
        self.phase("done")
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
            self._thread = None
        if self.path is not None:
            with contextlib.suppress(OSError):
                self._write()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            with contextlib.suppress(OSError):  # a filesystem hiccup: the next beat tries again
                self._write()

    def _write(self) -> None:
        # Replaced whole (readers never see half a file), not fsynced: a heartbeat is worth
        # nothing after a crash, and a sync per second per rank would load shared filesystems.
        assert self.path is not None
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        record = json.dumps(
            {
                "rank": self.rank,
                "host": self._host,
                "pid": os.getpid(),
                "step": self.step,
                "phase": self.current,
                "phase_since": round(self.since, 3),
                "last_step_s": self.last_step_s,
                "updated": round(time.time(), 3),
            }
        )
        tmp.write_text(record)
        os.replace(tmp, self.path)
