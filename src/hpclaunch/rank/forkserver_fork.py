"""Start ``multiprocessing``'s forkserver as a fork of the rank host, not as a new interpreter.

The rank host needs torch itself (the elastic launcher), and its forkserver needs torch, mmdit, DCP
and the trainer (``preload``) for the ranks it forks. Started the standard way, the forkserver is a
fresh interpreter that imports all of that a second time: on this project's 2-core machine the two
imports were 3.0 and 4.2 core-seconds of every allocation's start, per node, and a second copy of
torch in memory. Here the rank host imports the preload once and forks the forkserver from itself
while it is still single-threaded (a fork of a process with threads may inherit a lock some thread
held); the forkserver then runs ``multiprocessing.forkserver.main`` as the spawned one would, and
every rank is forked from it as before.

This drives ``multiprocessing.forkserver``'s module state (its listener address, the "alive" pipe,
the forkserver's pid), which is private: where it is not what this code knows (another Python's
layout), or where the host already runs a thread, ``start`` returns False and the caller starts the
forkserver the standard way.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import socket
import sys
from multiprocessing import connection, forkserver, resource_tracker, util
from typing import Any, cast

from .helper_signals import single_threaded

_STATE = ("_forkserver_address", "_forkserver_alive_fd", "_forkserver_pid")
_MAIN_PARAMS = ["listener_fd", "alive_r", "preload", "main_path", "sys_path"]


def supported() -> bool:
    """This Python's forkserver has the state and the ``main`` this module drives."""
    server = getattr(forkserver, "_forkserver", None)
    if server is None or not all(hasattr(server, name) for name in _STATE):
        return False
    try:
        params = list(inspect.signature(forkserver.main).parameters)
    except (TypeError, ValueError):
        return False
    return params == _MAIN_PARAMS


def start(*, keep_fds: tuple[int, ...] = ()) -> bool:
    """Fork this process into multiprocessing's forkserver (see the module docstring); False where
    that cannot be done safely (nothing started then). ``keep_fds`` are this process's own
    descriptors that the forkserver, and so every rank, must not inherit: they are closed in it."""
    server: Any = forkserver._forkserver  # (private state: see the module docstring)
    if not supported() or server._forkserver_pid is not None or not single_threaded():
        return False
    resource_tracker.ensure_running()  # (as ensure_running does first: the ranks report to it)
    with socket.socket(socket.AF_UNIX) as listener:
        address = cast(Any, connection).arbitrary_address("AF_UNIX")
        listener.bind(address)
        if not util.is_abstract_socket_namespace(address):
            os.chmod(address, 0o600)
        listener.listen()
        # every client owns the write end of the "alive" pipe; the forkserver leaves at its EOF
        alive_r, alive_w = os.pipe()
        for stream in (sys.stdout, sys.stderr):  # nothing buffered here is printed twice
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        pid = os.fork()
        if pid == 0:  # the forkserver: it never returns into the rank host's code
            code = 0
            try:
                os.close(alive_w)
                for fd in keep_fds:
                    with contextlib.suppress(OSError):
                        os.close(fd)
                forkserver.main(listener.fileno(), alive_r, [])  # preload: this process has it
            except SystemExit:
                pass  # (main's way out: every client has gone)
            except BaseException:
                code = 1
                with contextlib.suppress(Exception):
                    sys.excepthook(*sys.exc_info())
            finally:
                for stream in (sys.stdout, sys.stderr):
                    with contextlib.suppress(OSError, ValueError):
                        stream.flush()
                os._exit(code)
        os.close(alive_r)
    server._forkserver_address = address
    server._forkserver_alive_fd = alive_w
    server._forkserver_pid = pid
    return True
