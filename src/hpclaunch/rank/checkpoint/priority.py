"""CPU priority of the background writers: a save's CPU work yields to training on shared cores.

Two writers, two mechanisms: the thread writer lowers its own thread (``set_thread_nice``, used by
``background``); the writer process lowers itself once at start (``lower_process_priority``, used by
``writer_main``). A refusal by the kernel costs speed only, never the save. Imports nothing of the
package, so the modules that use it stay free of circles.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading


def set_thread_nice(added: int) -> None:
    """Run the calling thread at the process's niceness plus ``added`` (Linux: niceness is per
    thread, and the threads this one starts, DCP's writers included, inherit it). Elsewhere, or
    where the kernel refuses, the thread keeps its priority: a slower save, never a failed one."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError):
        base = os.getpriority(os.PRIO_PROCESS, os.getpid())  # the main thread's
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), min(19, base + added))


def lower_process_priority(nice: int, *, idle: bool) -> None:
    """The writer's CPU time yields to training where they share cores (a refusal costs speed only).

    ``idle`` (Linux SCHED_IDLE): it runs only on CPU time nothing else wants. The training process
    never waits for it except in ``wait`` (the next save, the end), and while it waits its own core
    is free; on a GPU node the cores it needs are idle anyway. Where other processes keep every core
    busy too, a waiting rank finds it starved and replaces it by one at ``nice`` (``starvation``):
    this process could not raise its own priority again. Else ``nice`` is added to its niceness
    (CFS still gives it a share of a busy core: ~10 % at +10)."""
    if idle and hasattr(os, "SCHED_IDLE"):
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            return
        except OSError:
            pass
    if nice > 0:
        with contextlib.suppress(OSError):
            os.nice(nice)
