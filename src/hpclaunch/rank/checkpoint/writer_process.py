"""The writer process as the training process sees it: started, fed, asked how it went, stopped.

One writer process per training rank (``writer_main``), taken by the rank's first background save
and kept for the attempt. The first is forked by the rank before its first thread (``prefork``:
it has the rank's imports, torch among them, and waits for its spec); a writer after a failed
save's is started with ``exec``. Either is the child of the thread that trains and dies with that
thread (the parent-death signal), so a rank killed with ``kill -9`` never leaves a writer behind that
publishes into the next attempt's directory. The rank hands it a staging buffer once (a file
descriptor over a Unix socket) and then one small JSON message per save; the writer answers with
one message per save (published, or failed with the reason). A writer that dies answers nothing:
the socket's end and its exit status say so, and that is reported as the save's failure.

The writers of one run form a gloo group of their own, rendezvousing through the store the ranks
joined (``MASTER_ADDR``/``MASTER_PORT``, from the elastic launcher) under a prefix that rank 0 chose for this
generation of writers: after a failure every rank stops its writer and the next background save
starts a new generation, so a half-broken group is never reused.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import replace
from typing import TYPE_CHECKING

from ...errors import CheckpointError
from ..helper_signals import single_threaded, stop_signals_blocked
from . import channel
from .fault_hooks import ENV_DELAY_WRITE, ENV_FAIL, ENV_KILL
from .writer_protocol import Answer, Failed, SaveRequest, WriterSpec, answer_from_json

if TYPE_CHECKING:
    from .staging import Staged
    from .writing import SaveJob

# The test hooks are read when save() is called, as with the thread writer: the training process
# sends what it sees with every save.
HOOK_VARS = (ENV_DELAY_WRITE, ENV_FAIL, ENV_KILL)
EXIT_WAIT_S = 10.0


def store_address(world_size: int) -> tuple[str, int] | None:
    """Where the writers meet: the store the ranks joined (None: one rank, no group needed)."""
    if world_size == 1:
        return None
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        raise CheckpointError(
            "checkpoint.writer: process needs MASTER_ADDR and MASTER_PORT (the store the elastic "
            "launcher starts) for the writers of several ranks to meet",
            hint="start the ranks with hpclaunch or torchrun, or set checkpoint.writer: thread",
        )
    return addr, int(port)


class ForkedChild:
    """A forked writer as ``subprocess.Popen`` shows a started one: pid, poll, wait, kill."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # (reaped elsewhere: gone, how is unknown)
                self.returncode = -9
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"checkpoint writer {self.pid}", timeout or 0.0)
            time.sleep(0.01)
        return code

    def kill(self) -> None:
        if self.poll() is None:
            os.kill(self.pid, signal.SIGKILL)


class _Waiting:
    """The writer ``prefork`` forked, until a save takes it."""

    def __init__(self, child: ForkedChild, sock: socket.socket, parent: int) -> None:
        self.child, self.sock, self.parent = child, sock, parent


_waiting: _Waiting | None = None


def prefork() -> bool:
    """Fork this rank's first writer now, while the rank is still single-threaded (a fork of a
    process with threads may inherit a lock some thread held): it has the rank's imports, torch
    among them, where a started one spends ~2 core-s importing them (every attempt, every rank),
    and it waits, using nothing, until the first background save sends its spec. It dies with
    the thread that forked it, as a started writer does. False (nothing forked): there is already
    one, the process runs threads, or the platform has no fork; the first save then starts one."""
    global _waiting
    from . import writer_main

    if _waiting is not None or not hasattr(os, "fork") or not single_threaded() or _group_started():
        return False
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    parent = os.getpid()
    for stream in (sys.stdout, sys.stderr):  # nothing buffered here is printed twice
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    with stop_signals_blocked():  # until the writer ignores them itself
        pid = os.fork()
        if pid == 0:  # the writer: it never returns into the rank's code
            code = 1
            try:
                ours.close()
                code = writer_main.main_forked(theirs, parent)
            except BaseException:
                with contextlib.suppress(Exception):
                    sys.excepthook(*sys.exc_info())
            finally:
                writer_main.leave(code)
    theirs.close()
    _waiting = _Waiting(ForkedChild(pid), ours, parent)
    return True


def _group_started() -> bool:
    """A process group runs (with its native threads): too late to fork."""
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized()


def _take_waiting() -> _Waiting | None:
    """The forked writer, for this process's first writer (a forked child's copy is not its own)."""
    global _waiting
    waiting, _waiting = _waiting, None
    if waiting is not None and waiting.parent != os.getpid():
        return None
    return waiting


def discard_waiting() -> None:
    """The rank is done and never took its forked writer: let it go (it leaves when its channel
    closes) and reap it."""
    waiting = _take_waiting()
    if waiting is None:
        return
    waiting.sock.close()
    try:
        waiting.child.wait(timeout=EXIT_WAIT_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(OSError):
            waiting.child.kill()


class WriterProcess:
    """One rank's writer process (see the module docstring)."""

    def __init__(self, spec: WriterSpec) -> None:
        waiting = _take_waiting()
        if waiting is not None and self._hand_over(waiting, spec):
            self.proc: subprocess.Popen[bytes] | ForkedChild = waiting.child
            self.sock = waiting.sock
        else:
            self.proc, self.sock = self._start(spec)
        self.rank = spec.rank
        self._layouts: set[str] = set()
        self._result: Answer | None = None

    @staticmethod
    def _hand_over(waiting: _Waiting, spec: WriterSpec) -> bool:
        """Send the forked writer its spec (False: it is gone; a writer is started instead)."""
        try:
            channel.send(waiting.sock, {"op": "spec", "spec": spec.to_json()})
            return True
        except (channel.ChannelClosed, OSError):
            waiting.sock.close()
            with contextlib.suppress(OSError, subprocess.TimeoutExpired):
                waiting.child.kill()
                waiting.child.wait(timeout=EXIT_WAIT_S)
            return False

    @staticmethod
    def _start(spec: WriterSpec) -> tuple[subprocess.Popen[bytes], socket.socket]:
        """A writer started with ``exec`` (a new interpreter)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        spec = replace(spec, fd=theirs.fileno(), parent=os.getpid())
        argv = [sys.executable, "-m", "hpclaunch.rank.checkpoint.writer_main", json.dumps(spec.to_json())]
        try:
            with stop_signals_blocked():  # until the writer ignores them itself
                proc = subprocess.Popen(argv, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        except OSError as e:
            ours.close()
            raise CheckpointError(f"cannot start the checkpoint writer process: {e}") from e
        finally:
            theirs.close()
        return proc, ours

    @property
    def pid(self) -> int:
        return int(self.proc.pid)

    def submit(self, job: SaveJob, staged: Staged) -> None:
        """Hand one save to the writer (its staging buffer first, when the writer has not seen it)."""
        layout = staged.layout
        hooks = {name: os.environ.get(name) for name in HOOK_VARS}
        try:
            if layout.id not in self._layouts:
                channel.send(self.sock, {"op": "layout", **layout.describe()}, [layout.fd])
                self._layouts = {layout.id}  # the writer keeps only the newest
            channel.send(self.sock, SaveRequest(layout.id, job, hooks, staged.objects).to_json())
        except channel.ChannelClosed:
            self._result = self._death()

    def poll(self, timeout: float | None = 0.0) -> Answer | None:
        """The answer to the save in flight, once there is one (a dead writer's answer is its death);
        ``timeout`` None waits for it."""
        if self._result is None:
            if channel.readable(self.sock, timeout):
                try:
                    self._result = answer_from_json(channel.recv(self.sock)[0])
                except (channel.ChannelClosed, ValueError):
                    self._result = self._death()
            elif self.proc.poll() is not None:
                self._result = self._death()
        return self._result

    def take(self) -> Answer:
        """The answer (after ``poll`` returned one); the writer is free for the next save."""
        result, self._result = self._result, None
        assert result is not None
        return result

    def _death(self) -> Failed:
        try:
            code = self.proc.wait(timeout=EXIT_WAIT_S)
        except subprocess.TimeoutExpired:
            code = None
        how = "still running, its channel closed" if code is None else _exit_text(code)
        return Failed(
            f"the checkpoint writer process of rank {self.rank} (pid {self.pid}) died ({how})",
            hint="the save is retried in the training process; see the node log for the writer's last words",
            dead=True,
        )

    def kill(self) -> None:
        """Stop it now (a failed save: it may be waiting for a peer that is gone)."""
        with contextlib.suppress(OSError):
            self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=EXIT_WAIT_S)
        self.sock.close()

    def close(self) -> None:
        """Ask it to leave (nothing in flight), then make sure it has."""
        with contextlib.suppress(channel.ChannelClosed, OSError):
            channel.send(self.sock, {"op": "exit"})
        try:
            self.proc.wait(timeout=EXIT_WAIT_S)
        except subprocess.TimeoutExpired:
            self.kill()
        self.sock.close()


def _exit_text(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
        return f"killed by signal {-code}"
    return f"exit code {code}"
