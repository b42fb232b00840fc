"""The node agent's side of the rank host (``hpclaunch.rank.host``, started by module name so
that ``jobs`` never imports the trainer).

One rank host per node per allocation, started as the agent starts (it warms up, importing the
trainer into its forkserver, while the node checks run), with the plan's command
(``JobPlan.rank_host_argv``: in the run's container image when it has one). Each attempt is a
request on its stdin; while it runs, the agent keeps polling (its relay, its watchdog) and asks
``result()``; the host's replies are the marked lines of its stderr. The ranks' output and the
host's own go through ``LogSink`` into the current attempt's node log (and to the terminal).
"""

from __future__ import annotations

import contextlib
import json
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import BinaryIO

from ..rank.helper_signals import launcher_preexec
from ..rundir.attempt_records import REPLY_MARK, AttemptEnd, HostReady, HostReply, RankRequest
from ..rundir.plan import LAUNCHER_MODULE  # noqa: F401  (re-exported: where tests look for it)

_MARK = REPLY_MARK.encode()


class LogSink:
    """Where output goes now: the current attempt's node log (switched per attempt), and echo."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._file: BinaryIO | None = None

    def switch(self, path: Path, header: str) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with self._lock:
            if self._file is not None:
                self._file.close()
            self._file = open(path, "ab")  # noqa: SIM115 (kept open until the next attempt)
            self._file.write(header.encode())
            self._file.flush()

    def write(self, line: bytes) -> None:
        with self._lock:
            if self._file is not None:
                self._file.write(line)
                self._file.flush()

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


class RankHost:
    """A started ``hpclaunch.rank.host`` process and the pipes to it."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: Path, sink: LogSink, *, echo_stderr: bool):
        self.sink = sink
        self.argv = argv
        self.proc = subprocess.Popen(
            argv,
            env=env,
            cwd=str(cwd),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            preexec_fn=launcher_preexec,
        )
        self.started_at = time.time()
        self._replies: queue.Queue[HostReply] = queue.Queue()
        self.forkserver_pid: int | None = None
        self.host_pid: int | None = None  # the launcher's own (a runtime may stand between: podman, srun)
        self._threads = [
            threading.Thread(target=self._tee, args=(self.proc.stdout, True), daemon=True),
            threading.Thread(target=self._tee, args=(self.proc.stderr, echo_stderr, True), daemon=True),
        ]
        for thread in self._threads:
            thread.start()
        self._ready: HostReady | None = None
        self.token = ""  # what it writes in the node directory at its start (``rundir.node_dir``)
        self.node_dir_seen: bool | None = None  # whether the agent found it there (None: not looked)

    # ---- life ------------------------------------------------------------------------------------

    def wait_ready(self, timeout_s: float) -> bool:
        """True once the host runs its forkserver (the trainer is being imported into it)."""
        if self._ready is not None:
            return True
        deadline = time.time() + timeout_s
        while time.time() < deadline and self.alive():
            try:
                message = self._replies.get(timeout=0.2)
            except queue.Empty:
                continue
            if "ready" in message:
                self._ready = message["ready"]
                self.forkserver_pid = int(self._ready.get("forkserver") or 0) or None
                self.host_pid = int(self._ready.get("pid") or 0) or None
                return True
        return False

    def alive(self) -> bool:
        return self.proc.poll() is None

    def begin(self, request: RankRequest) -> None:
        """Start one attempt (the host rendezvouses and forks the ranks)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps({"attempt": request}) + "\n").encode())
        self.proc.stdin.flush()

    def result(self) -> AttemptEnd | None:
        """The attempt's end once it came (``state``, ``returncode``); ``lost`` if the host died."""
        try:
            message = self._replies.get_nowait()
        except queue.Empty:
            if self.alive():
                return None
            code = self.proc.returncode
            return {"state": "lost", "returncode": code if code is not None else -9}
        done = message.get("done")
        return done.copy() if done else {"state": "failed", "returncode": 1, "error": str(message)}

    def rank_pids(self) -> list[int]:
        """The ranks of the running attempt: the forkserver's children (their DataLoader workers are
        the ranks' own children, not these)."""
        import psutil

        if self.forkserver_pid is None:
            return []
        try:
            return [p.pid for p in psutil.Process(self.forkserver_pid).children(recursive=False)]
        except psutil.NoSuchProcess:
            return []

    def close(self, timeout_s: float = 10.0) -> None:
        """Ask the host to exit, then make sure it and everything it started are gone."""
        if self.alive():
            with contextlib.suppress(BrokenPipeError, OSError, AttributeError):
                assert self.proc.stdin is not None
                self.proc.stdin.write(b'{"exit": true}\n')
                self.proc.stdin.flush()
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        for thread in self._threads:
            thread.join(timeout=5)

    def kill(self) -> None:
        """SIGKILL the host, its forkserver and every rank (nothing of it may outlive the agent): the
        process started here and all below it, and the launcher and all below it where a container
        runtime started it elsewhere (podman's conmon, srun's step)."""
        import psutil

        family: list[psutil.Process] = []
        for pid in dict.fromkeys(p for p in (self.proc.pid, self.host_pid) if p):
            try:
                family += [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
            except psutil.NoSuchProcess:
                continue
        for p in family:
            with contextlib.suppress(psutil.Error):
                p.send_signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)

    # ---- pipes -----------------------------------------------------------------------------------

    def _tee(self, source: BinaryIO | None, echo: bool, replies: bool = False) -> None:
        if source is None:
            return
        for line in iter(source.readline, b""):
            if replies and (at := line.find(_MARK)) >= 0:
                # (a line another process left unfinished may stand before the reply)
                with contextlib.suppress(json.JSONDecodeError):
                    self._replies.put(json.loads(line[at + len(_MARK) :]))
                line = line[:at] + b"\n" if at else b""
                if not line:
                    continue
            self.sink.write(line)
            if echo:
                try:
                    sys.stdout.buffer.write(line)
                    sys.stdout.flush()
                except (AttributeError, ValueError, OSError):
                    pass
