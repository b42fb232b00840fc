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
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, cast

from ..fsutil import JSONObject
from ..probe_shapes import (  # the shapes the probe prints, as the trainer's scripts write them
    ProbeAnswer,
    ProbeRequest,
    ScriptMeasure,
    ScriptRequest,
    StepMeasure,
    StepRequest,
)
from ..rundir.container import ContainerPlan
from ..rundir.env import NODE_DIR_TOKEN_VAR, NODE_DIR_VAR
from ..rundir.node_dir import NodeDir

# Run as a script by path (never imported here): it lives with the trainer, whose model it builds.
_SCRIPT = Path(__file__).resolve().parents[1] / "trainer" / "probe_main.py"


class _Line(ProbeAnswer, total=False):
    """One JSON line the probe printed: its answer, then (when asked) the measured steps or the
    script's attach."""

    step_estimate: StepMeasure
    script_probe: ScriptMeasure
    __unparsed__: str  # a line that began with "{" but was no JSON


def _is_answer(line: _Line) -> bool:
    """The probe's answer, not a line it printed after it (the steps, the script)."""
    return "step_estimate" not in line and "script_probe" not in line


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


@dataclass(frozen=True)
class InImage:
    """A probe run in the run's image, through its runtime (``container``), with ``node_dir``
    mounted as a node agent mounts it for its ranks."""

    container: ContainerPlan
    node_dir: NodeDir | None = None


class Probe:
    """One running probe; ``result()`` waits (bounded) and caches the answer for every check.

    With ``estimate`` (preflight's request for a few measured training steps, see
    ``preflight/run_estimate.py``) the same process goes on, after its answer, to time those steps, so
    that the estimate pays no second torch import and runs while the checks do: the answer is then
    the first JSON line (the checks need not wait for the steps), the steps' result the line
    ``{"step_estimate": {...}}`` after it, read by ``step_estimate()``. Without it the answer is
    the last JSON line of a process that exited 0, as it always was.
    """

    def __init__(
        self,
        python: str | None,
        *,
        model: JSONObject | None,
        timeout_s: float,
        estimate: StepRequest | None = None,
        env: dict[str, str] | None = None,
        script: ScriptRequest | None = None,
        image: InImage | None = None,
    ):
        """``image``: run ``python`` (the image's) in the run's image with its node directory
        mounted: the probe writes a token there (``node_dir_proof``), which the container check reads
        back outside. ``script``: a script's run, run as far as its attach after the answer
        (``script_probe``)."""
        self.python = python
        self.node_dir_proof: tuple[NodeDir, str] | None = None
        self.timeout_s = timeout_s
        self.estimating = estimate is not None
        self.probing_script = script is not None
        # the answer is the first line and the process goes on (to time steps, or to run a script)
        self._goes_on = self.estimating or self.probing_script
        self._lock = threading.Lock()
        self._result: ProbeAnswer | None = None
        self._error: str | None = None
        self._proc: subprocess.Popen[str] | None = None
        self._started = time.monotonic()
        self._lines: list[_Line] = []  # the JSON lines printed so far, in order
        self._stderr: list[str] = []
        self._eof = False
        self._changed = threading.Condition()
        if python is None:
            self._error = "not found on this machine"
            return
        penv = dict(os.environ)
        penv.pop("PYTHONPROFILEIMPORTTIME", None)
        penv["PYTHONDONTWRITEBYTECODE"] = "1"
        penv.update(env or {})
        # -c, not the file path: a script's directory goes first on sys.path, and this one holds
        # modules (env, data, network, ...) that would shadow real ones in the probe; and in an
        # image the text needs no file of this machine's.
        argv = [python, "-c", _SCRIPT.read_text()]
        if image is not None:
            container, node_dir = image.container, image.node_dir
            mounted = str(node_dir.path) if node_dir is not None else None
            if node_dir is not None:
                token = uuid.uuid4().hex
                penv.update({NODE_DIR_VAR: str(node_dir.ranks_path), NODE_DIR_TOKEN_VAR: token})
                self.node_dir_proof = (node_dir, token)
            argv, penv = container.wrap(argv, node_dir=mounted, env=penv), container.environment(penv)
        try:
            self._proc = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=penv,
                start_new_session=True,
            )
        except OSError as e:
            self._error = f"cannot start {python}: {e.strerror}"
            return
        self._err_reader = threading.Thread(target=self._read_stderr, name="probe-err", daemon=True)
        self._err_reader.start()
        threading.Thread(target=self._read_stdout, name="probe-out", daemon=True).start()
        request: ProbeRequest = {"model": model}
        if estimate is not None:
            request["estimate"] = estimate
        if script is not None:
            request["script"] = script
        send_request(self._proc, json.dumps(request))

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def _read_stdout(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        with contextlib.suppress(OSError, ValueError):
            for line in self._proc.stdout:
                if not line.startswith("{"):
                    continue
                try:
                    parsed = json.loads(line)
                except ValueError:
                    parsed = {"__unparsed__": line[:300]}
                # an object the probe printed is one of its lines (probe_main.py writes these shapes)
                with self._changed:
                    self._lines.append(cast(_Line, parsed) if isinstance(parsed, dict) else {})
                    self._changed.notify_all()
        self._proc.wait()
        self._err_reader.join(5)  # its last lines say why a failed probe failed
        with self._changed:
            self._eof = True
            self._changed.notify_all()

    def _read_stderr(self) -> None:
        assert self._proc is not None and self._proc.stderr is not None
        with contextlib.suppress(OSError, ValueError):
            for line in self._proc.stderr:
                self._stderr.append(line)
                del self._stderr[:-20]

    def _wait_for(self, ready: Callable[[], bool], deadline: float) -> bool:
        """Wait until ``ready()`` or the process's end (True), or the deadline (False)."""
        with self._changed:
            while not (ready() or self._eof):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(left)
            return True

    def _why_failed(self) -> str:
        proc = self._proc
        assert proc is not None
        tail = "".join(self._stderr).strip().splitlines()[-1:] or [f"exit code {proc.returncode}"]
        return f"failed: {tail[0][:300]}"

    def result(self, timeout: float | None = None) -> ProbeAnswer:
        """The probe's JSON; raises ProbeError (why) when it failed or took longer than allowed."""
        with self._lock:
            if self._result is None and self._error is None:
                self._wait(timeout)
            if self._error is not None:
                raise ProbeError(self._error)
            assert self._result is not None
            return self._result

    def _wait(self, timeout: float | None) -> None:
        deadline = self._started + self.timeout_s
        if timeout is not None:
            deadline = min(deadline, time.monotonic() + timeout)

        def answered() -> bool:
            return self._goes_on and any(_is_answer(ln) for ln in self._lines)

        if not self._wait_for(answered, deadline):
            if time.monotonic() - self._started < self.timeout_s:
                # only this caller's patience ran out: leave the probe running for the next one
                raise ProbeError(f"no answer within {timeout:g} s")
            self.close()
            self._error = f"no answer within {self.timeout_s:g} s"
            return
        with self._changed:
            lines = [ln for ln in self._lines if _is_answer(ln)]
            ended = self._eof
        if self._goes_on and lines:
            line = lines[0]  # printed before the steps began; the process goes on with them
        else:
            assert ended and self._proc is not None
            if self._proc.returncode != 0 or not lines:
                self._error = self._why_failed()
                return
            line = lines[-1]
        if "__unparsed__" in line:
            self._error = "printed no JSON"
            return
        self._result = line

    def step_estimate(self, timeout_s: float) -> StepMeasure:
        """The measured steps (``trainer/step_probe.py``'s answer) or ``{"error": why}``.

        Waits until ``timeout_s`` after the probe started; past it the probe is killed.
        """
        late = f"the measured steps took longer than {timeout_s:.0f} s"
        return cast("StepMeasure", self._later_line("step_estimate", self.estimating, timeout_s, late))

    def script_probe(self, timeout_s: float) -> ScriptMeasure:
        """What the script showed at its attach (``rank/script_probe.py``) or ``{"error": why}``."""
        late = f"the script did not reach hpclaunch.attach() within {timeout_s:.0f} s"
        return cast("ScriptMeasure", self._later_line("script_probe", self.probing_script, timeout_s, late))

    def _later_line(
        self, key: Literal["step_estimate", "script_probe"], requested: bool, timeout_s: float, late: str
    ) -> JSONObject:
        """What the probe printed under ``key`` after its answer, or ``{"error": why}``: not
        ``requested``, the probe never started or failed, or ``late`` when it had printed nothing
        ``timeout_s`` after its start (it is killed then)."""
        if not requested:
            return {"error": "not requested"}
        if self._proc is None:
            return {"error": f"the job's Python: {self._error}"}

        def printed() -> bool:
            return any(key in ln for ln in self._lines)

        if not self._wait_for(printed, self._started + timeout_s):
            self.close()
            return {"error": late}
        with self._changed:
            found = next((ln[key] for ln in self._lines if key in ln), None)
        if isinstance(found, dict):
            return cast("JSONObject", found)
        return {"error": self._why_failed().removeprefix("failed: ")}

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
        self, result: ProbeAnswer | None = None, *, error: str = "not run", python: str | None = "python"
    ):
        self.python = python
        self._result = result
        self._error = error

    def result(self, timeout: float | None = None) -> ProbeAnswer:
        if self._result is None:
            raise ProbeError(self._error)
        return self._result

    def step_estimate(self, timeout_s: float) -> StepMeasure:
        return {"error": self._error}

    def script_probe(self, timeout_s: float) -> ScriptMeasure:
        return {"error": self._error}

    def close(self) -> None:
        pass
