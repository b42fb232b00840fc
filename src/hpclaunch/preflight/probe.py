"""The job-Python probe: a subprocess started first so that its torch import overlaps the other checks.

The CLI never imports torch (it must feel instant), so everything torch knows (versions, CUDA, NCCL,
devices, the model's exact parameter count) comes from ``trainer/probe_main.py`` run by the interpreter the
job will use: ``launch.python`` or this one.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

# Run as a script by path (never imported here): it lives with the trainer, whose model it builds.
_SCRIPT = Path(__file__).resolve().parents[1] / "trainer" / "probe_main.py"


class ProbeError(Exception):
    """The probe could not run or did not answer; the message says why (one line)."""


def job_python(launch_python: str | None) -> str | None:
    """The job's interpreter as a path here, or None when it cannot be found on this machine."""
    if not launch_python:
        return sys.executable
    if os.sep in launch_python:
        return launch_python if os.access(launch_python, os.X_OK) else None
    return shutil.which(launch_python)


def send_request(proc: subprocess.Popen[str], text: str) -> None:
    """Write the request to the probe's stdin and close it, whatever state the probe is in.

    A probe that died at once (a broken interpreter) has closed its end: the write or the flush in
    ``close()`` raises BrokenPipeError, and the file ends up closed anyway. ``proc.stdin`` is cleared
    first so that ``communicate()`` never flushes a closed file (ValueError); the exit code and
    stderr then say why the probe failed.
    """
    stdin, proc.stdin = proc.stdin, None
    if stdin is None:
        return
    try:  # a few hundred bytes: fits the pipe buffer, never blocks
        stdin.write(text)
        stdin.close()
    except OSError:
        with contextlib.suppress(OSError):
            stdin.close()


class Probe:
    """One running probe; ``result()`` waits (bounded) and caches the answer for every check."""

    def __init__(self, python: str | None, *, model: dict[str, Any] | None, timeout_s: float):
        self.python = python
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._result: dict[str, Any] | None = None
        self._error: str | None = None
        self._proc: subprocess.Popen[str] | None = None
        self._started = time.monotonic()
        if python is None:
            self._error = "not found on this machine"
            return
        env = dict(os.environ)
        env.pop("PYTHONPROFILEIMPORTTIME", None)
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        try:
            # -c, not the file path: a script's directory goes first on sys.path, and this one
            # holds modules (env, data, network, ...) that would shadow real ones in the probe.
            self._proc = subprocess.Popen(
                [python, "-c", _SCRIPT.read_text()],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
                start_new_session=True,
            )
        except OSError as e:
            self._error = f"cannot start {python}: {e.strerror}"
            return
        send_request(self._proc, json.dumps({"model": model}))

    def result(self, timeout: float | None = None) -> dict[str, Any]:
        """The probe's JSON; raises ProbeError (why) when it failed or took longer than allowed."""
        with self._lock:
            if self._result is None and self._error is None:
                self._wait(timeout)
            if self._error is not None:
                raise ProbeError(self._error)
            assert self._result is not None
            return self._result

    def _wait(self, timeout: float | None) -> None:
        proc = self._proc
        assert proc is not None
        budget = self.timeout_s - (time.monotonic() - self._started)
        if timeout is not None:
            budget = min(budget, timeout)
        try:
            out, err = proc.communicate(timeout=max(budget, 0.01))
        except subprocess.TimeoutExpired:
            if time.monotonic() - self._started < self.timeout_s:
                # only this caller's patience ran out: leave the probe running for the next one
                raise ProbeError(f"no answer within {timeout:g} s") from None
            self.close()
            self._error = f"no answer within {self.timeout_s:g} s"
            return
        line = next((ln for ln in reversed(out.splitlines()) if ln.startswith("{")), None)
        if proc.returncode != 0 or line is None:
            tail = (err or out).strip().splitlines()[-1:] or [f"exit code {proc.returncode}"]
            self._error = f"failed: {tail[0][:300]}"
            return
        try:
            self._result = json.loads(line)
        except ValueError:
            self._error = "printed no JSON"

    def close(self) -> None:
        """Kill the probe if it is still running (a check that timed out must not leave it behind)."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            try:
                os.killpg(proc.pid, 9)
            except OSError:
                proc.kill()
            proc.wait()


class StaticProbe:
    """A probe with a fixed answer: for checks that do not need one, and for tests."""

    def __init__(
        self, result: dict[str, Any] | None = None, *, error: str = "not run", python: str | None = "python"
    ):
        self.python = python
        self._result = result
        self._error = error

    def result(self, timeout: float | None = None) -> dict[str, Any]:
        if self._result is None:
            raise ProbeError(self._error)
        return self._result

    def close(self) -> None:
        pass
