"""One signal policy for every process that runs beside the ranks: the rank host (torch's elastic
launcher), each rank's DataLoader workers and its checkpoint writer process.

A scheduler's stop signals go to every process of the job (SLURM signals the whole step, PBS and
the local scheduler the job's process group, a terminal its foreground group). Stopping is the
ranks' business (``rank.stop``: the signal only sets a flag, every rank stops after the same step
and saves): a helper that dies of the signal instead takes its rank's save down with it (a
DataLoader worker "killed by signal" in the middle of the stop save, a checkpoint writer killed by
the time-limit warning). So a helper ignores the stop signals and ends when its rank tells it to,
or with its rank (``die_with_parent``: SIGKILL from the kernel when the rank is gone).

A helper runs code before it can ignore anything: Python's start-up and imports after ``exec``,
torch's own worker set-up (with its SIGTERM handler) in a forked DataLoader worker.
``stop_signals_blocked`` closes that window: the signals are blocked in the starting thread while
the child is created, the child inherits the mask (through ``fork`` and ``exec``; a blocked signal
stays pending, it is not lost or delivered), and ``ignore_stop_signals`` in the child ignores them
(which discards a pending one) and then unblocks them. This module imports nothing heavy: the writer calls it first.
"""

from __future__ import annotations

import contextlib
import signal
import sys
from collections.abc import Iterator

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)
PR_SET_PDEATHSIG = 1


def ignore_stop_signals() -> None:
    """In a helper process: the stop signals are ignored from now on (and no longer blocked)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


@contextlib.contextmanager
def stop_signals_blocked() -> Iterator[None]:
    """Around starting a helper (fork or ``exec``): the child starts with the stop signals blocked
    (see the module docstring). The starting process receives any that arrived meanwhile when this ends."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def die_with_parent() -> None:
    """Linux: the kernel SIGKILLs this process when the thread that started it dies (no orphan
    lingers; SIGKILL because the stop signals are ignored here). Elsewhere: nothing."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def launcher_preexec() -> None:
    """Runs in the rank host's process before exec: ignored dispositions survive exec (and reach the
    ranks, which install their own handlers)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def single_threaded() -> bool:
    """No Python thread in this process but the caller's. A helper is forked only then, and before
    the process starts native threads of its own (a process group's, a store's): a fork of a
    process with threads may inherit a lock one of them held, and hang on it. Native threads are
    not counted here, since a library starts a pool at import that is safe (OpenBLAS's, under
    numpy: it stops and restarts around a fork itself, with ``pthread_atfork``)."""
    import threading

    return threading.active_count() == 1
