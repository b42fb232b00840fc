"""Every rank's progress, reported without a collective: the step it is on, the phase it is in, and
how its steps split into its own work and waiting.

The training loop only sets attributes (``phase(name)``, ``stepped(step, seconds)``: a clock read
and a few additions); a daemon thread writes ``RUN/attempts/<attempt>/rank<r>.progress.json``
about once a second (file names: ``rundir.progress_files``). The node agent's watchdog reads these files:
a rank whose step and phase have not changed for longer than the phase's window is stuck, and the
phase tells where. The thread keeps writing while the main thread hangs, and it samples the main
thread's stack: a rank blocked in a ``torch.distributed`` call says so (``waiting``), which tells
the ranks that wait from the one they wait for.

Step times. From the first ``data`` phase of a step to ``stepped`` the rank adds up wall time per
phase and, on CPU ranks, its main thread's CPU time: gloo waits block without using CPU, so CPU
time is the rank's own work and the rest is waiting (also the waiting DDP hides inside backward).
On GPU ranks the host cannot tell kernel time from NCCL waits, so own work is the host time spent
in the data and compute phases. Every ``summary_every`` steps the thread appends one line to
``RUN/steptimes/rank<r>.jsonl``; the node agent compares ranks there (stragglers).

``register_stack_dump`` (called by the entry point before the process group exists) makes the rank
write every thread's Python stack to ``RUN/logs/attempt-<attempt>/rank<r>.stacks.txt`` when it
gets ``STACK_SIGNAL``; faulthandler does it in C, so it works while the main thread is stuck.

Phases: startup, load, data, compute, collective, save, eval, done.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import IO

from ..config import RunConfig
from ..fsutil import append_line
from ..rundir import RunPaths
from ..rundir.env import NODE_NAME_VAR, PROGRESS_DIR_VAR
from ..rundir.progress_files import (
    PHASES,
    STACK_SIGNAL,
    TRAINING_PHASES,
    StepTimes,
    progress_file,
    stacks_file,
    steptimes_file,
)
from .fault_injection import TestFaults

__all__ = ["PHASES", "Progress", "drop_empty_stack_dump", "register_stack_dump"]

# Python frames that block until the other ranks arrive: c10d's collectives, and DDP's buffer
# broadcast at the start of forward.
_C10D_FILE = os.path.join("torch", "distributed", "distributed_c10d.py")
_DDP_FILE = os.path.join("torch", "nn", "parallel", "distributed.py")
_stack_file: IO[str] | None = None  # kept open for faulthandler for the life of the process


def register_stack_dump(cfg: RunConfig, paths: RunPaths, attempt: str, rank: int) -> Path | None:
    """Dump every thread's stack into this rank's stacks file on ``STACK_SIGNAL`` (watchdog on)."""
    global _stack_file
    if not cfg.watchdog.enabled:
        return None
    path = stacks_file(paths, attempt, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    if _stack_file is not None:
        _stack_file.close()
    _stack_file = open(path, "a")  # noqa: SIM115 - faulthandler writes to it until the process ends
    faulthandler.register(STACK_SIGNAL, file=_stack_file, all_threads=True, chain=False)
    return path


def drop_empty_stack_dump() -> None:
    """At a rank's orderly end: its stacks file, when nothing was dumped into it, goes (an empty
    ``rank<r>.stacks.txt`` in every attempt said nothing; one with stacks is a hang's evidence)."""
    if _stack_file is None:
        return
    with contextlib.suppress(OSError, ValueError):
        path = Path(_stack_file.name)
        if path.stat().st_size == 0:
            path.unlink()


class Progress:
    def __init__(
        self,
        path: Path | None,
        *,
        rank: int,
        every_s: float = 1.0,
        attempt: str = "local",
        node: str | None = None,
        steptimes: Path | None = None,
        summary_every: int = 50,
    ):
        self.path = path
        self.rank = rank
        self.every_s = every_s
        self.attempt = attempt
        self.node = node or os.environ.get(NODE_NAME_VAR) or socket.gethostname().split(".")[0]
        self.steptimes = steptimes
        self.summary_every = summary_every
        # CPU ranks: main-thread CPU time is own work (see the docstring); set once the rank knows
        # its device. ``on_phase``: the testing faults' hook at every phase change (``for_rank``).
        self.cpu_time = True
        self.on_phase: Callable[[str, int], None] | None = None
        self.step = 0
        self.current = "startup"
        self.since = time.time()
        self.last_step_s: float | None = None
        self._recent: deque[float] = deque(maxlen=20)
        self._open_step = -1  # the step whose time is being added up (-1: none)
        self._step_phases = dict.fromkeys(TRAINING_PHASES, 0.0)
        self._cpu0 = 0.0
        self._window: dict[str, float] = {}
        self._pending: list[StepTimes] = []  # step-time summaries the thread still has to write
        # The last few summaries, in the heartbeat too: the node agent passes them on to the
        # decider's straggler tracker without reading the shared steptimes files.
        self._summaries: deque[StepTimes] = deque(maxlen=4)
        self._main = threading.get_ident()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._host = socket.gethostname().split(".")[0]

    @classmethod
    def for_rank(
        cls,
        cfg: RunConfig,
        paths: RunPaths,
        attempt: str,
        rank: int,
        *,
        device_type: str,
        enabled: bool = True,
    ) -> Progress:
        """This rank's reporter as the config asks (no files when the watchdog is off)."""
        faults = TestFaults.from_config(cfg.testing, paths, rank)
        hook = faults.on_phase if faults is not None else None
        if not (enabled and cfg.watchdog.enabled):
            progress = cls(None, rank=rank, attempt=attempt)
        else:
            # On its node when its agent collects it (one file per node on the shared filesystem).
            local = os.environ.get(PROGRESS_DIR_VAR)
            progress = cls(
                Path(local) / f"rank{rank}.progress.json" if local else progress_file(paths, attempt, rank),
                rank=rank,
                attempt=attempt,
                steptimes=steptimes_file(paths, rank),
                summary_every=cfg.watchdog.straggler_every,
            )
            progress.cpu_time = device_type == "cpu"
        progress.on_phase = hook
        return progress

    def start(self) -> Progress:
        if self.path is not None and self._thread is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if self.steptimes is not None:
                self.steptimes.parent.mkdir(parents=True, exist_ok=True)
            self._write()
            self._thread = threading.Thread(target=self._run, name="hpclaunch-progress", daemon=True)
            self._thread.start()
        if self.on_phase is not None:
            self.on_phase(self.current, self.step)
        return self

    # ---- the hot path: attribute writes and clock reads (microseconds a step) -------------------

    def phase(self, name: str, step: int | None = None) -> None:
        """Enter phase ``name`` (of ``step``, when given). Safe in the hot loop."""
        if step is not None:
            self.step = step
        if name != self.current:
            now = time.time()
            if self.steptimes is not None:
                self._account(name, now)
            self.current = name
            self.since = now
        if self.on_phase is not None:
            self.on_phase(name, self.step)

    def _account(self, name: str, now: float) -> None:
        """Time per phase within a step; a step opens with its first ``data`` phase."""
        if self._open_step >= 0 and self.current in self._step_phases:
            self._step_phases[self.current] += now - self.since
        if name == "data" and self.step != self._open_step:
            self._open_step = self.step
            self._step_phases = dict.fromkeys(TRAINING_PHASES, 0.0)
            self._cpu0 = time.thread_time() if self.cpu_time else 0.0

    def stepped(self, step: int, seconds: float) -> None:
        """Step ``step`` is done after ``seconds`` of wall time."""
        self.step = step
        self.last_step_s = seconds
        self._recent.append(seconds)
        if self._open_step < 0:  # no step open: not accounting (watchdog off) or a step without data
            return
        if self.current in self._step_phases:
            self._step_phases[self.current] += time.time() - self.since
        parts = self._step_phases
        work = time.thread_time() - self._cpu0 if self.cpu_time else parts["data"] + parts["compute"]
        self._open_step = -1
        w = self._window
        for key, value in (("wall", seconds), ("work", min(work, seconds)), *parts.items()):
            w[key] = w.get(key, 0.0) + value
        w["steps"] = w.get("steps", 0.0) + 1
        if step % self.summary_every == 0:
            self._pending.append(self._summary(step))
            self._window = {}

    def close(self) -> None:
        self.phase("done")
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
            self._thread = None
        if self.path is not None:
            with contextlib.suppress(OSError):
                self._write()

    # ---- the writer thread --------------------------------------------------------------------

    def _summary(self, step: int) -> StepTimes:
        w, n = self._window, self._window["steps"]
        mean = {k: round(v / n, 6) for k, v in w.items() if k != "steps"}
        return {
            "ts": round(time.time(), 3),
            "attempt": self.attempt,
            "rank": self.rank,
            "node": self.node,
            "step": step,
            "steps": int(n),
            "step_s": mean["wall"],
            "work_s": mean["work"],
            "wait_s": round(mean["wall"] - mean["work"], 6),
            "data_s": mean["data"],
            "compute_s": mean["compute"],
            "collective_s": mean["collective"],
            "basis": "cpu_time" if self.cpu_time else "host_phases",
        }

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            with contextlib.suppress(OSError):  # a filesystem hiccup: the next beat tries again
                self._write()

    def _write(self) -> None:
        # Replaced whole (readers never see half a file), not fsynced: a heartbeat is worth
        # nothing after a crash, and a sync per second per rank would load shared filesystems.
        assert self.path is not None
        while self._pending and self.steptimes is not None:
            append_line(self.steptimes, json.dumps(self._pending[0]))
            self._summaries.append(self._pending.pop(0))
        recent = tuple(self._recent)  # one C call: safe while the main thread appends
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        record = json.dumps(
            {
                "rank": self.rank,
                "node": self.node,
                "host": self._host,
                "pid": os.getpid(),
                "attempt": self.attempt,
                "step": self.step,
                "phase": self.current,
                "phase_since": round(self.since, 3),
                "last_step_s": self.last_step_s,
                "recent_max_step_s": max(recent) if recent else None,
                "waiting": self._waiting_in(),
                "updated": round(time.time(), 3),
                "summaries": list(self._summaries),
            }
        )
        tmp.write_text(record)
        os.replace(tmp, self.path)

    def _waiting_in(self) -> str | None:
        """The torch.distributed call the main thread is in right now (its innermost), if any."""
        frame = sys._current_frames().get(self._main)
        while frame is not None:
            code = frame.f_code
            if code.co_filename.endswith(_C10D_FILE) or (
                code.co_filename.endswith(_DDP_FILE) and code.co_name == "_distributed_broadcast_coalesced"
            ):
                return code.co_name
            frame = frame.f_back
        return None
