"""External commands with a deadline that holds (``run``): the node checks' ``nvidia-smi``, the
scheduler's ``sbatch``/``scontrol``/``qstat``, everything the agent and the CLI start and wait for.

``subprocess.run(timeout=...)`` does not bound the wait. After its timeout it kills the child alone
and then reads the child's pipes to their end, without a limit: a grandchild that still holds them
(a wrapper script's ``sleep``, a daemon that ``nvidia-smi`` left behind) or a child stuck in the
kernel (``nvidia-smi`` in D-state on a wedged driver, which a SIGKILL reaches only when it leaves
the kernel) keeps that read, and the agent that called it, waiting for ever. The decider then keeps
beating while it waits, nobody takes the role over, and the allocation burns until its time limit.

Here every command runs in its own session (its own process group): at the deadline the whole
group gets SIGKILL, and the output is read for at most ``KILL_GRACE_S`` more; what has not arrived
by then is abandoned, the pipes are closed, and a daemon thread reaps the child whenever it exits.
The call raises ``subprocess.TimeoutExpired`` as ``subprocess.run`` does, so callers keep their
handling.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

KILL_GRACE_S = 2.0  # after the group's SIGKILL: how long the output may still take to arrive


def run(
    argv: Sequence[str],
    *,
    timeout: float,
    cwd: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    input: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(argv, capture_output=True, text=True, timeout=timeout)`` whose wait ends
    at ``timeout`` plus at most ``KILL_GRACE_S`` whatever the command does (see the module
    docstring). Raises ``subprocess.TimeoutExpired`` at the deadline, ``OSError`` (FileNotFoundError
    among them) when the command cannot start."""
    proc = subprocess.Popen(
        list(argv),
        stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
        env=dict(env) if env is not None else None,
        start_new_session=True,  # its own process group: the deadline reaches what it started
    )
    try:
        out, err = proc.communicate(input, timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        out, err = _leftovers(proc)
        raise subprocess.TimeoutExpired(list(argv), timeout, output=out, stderr=err) from None
    except BaseException:
        kill_group(proc)
        _abandon(proc)
        raise
    return subprocess.CompletedProcess(list(argv), proc.returncode, out, err)


def kill_group(proc: subprocess.Popen[str]) -> None:
    """SIGKILL the command's whole process group (it leads its own session)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        proc.kill()


def _leftovers(proc: subprocess.Popen[str]) -> tuple[str, str]:
    """What the killed command wrote, read for at most ``KILL_GRACE_S``; then given up."""
    try:
        out, err = proc.communicate(timeout=KILL_GRACE_S)
        return out or "", err or ""
    except (subprocess.TimeoutExpired, ValueError, OSError):
        _abandon(proc)
        return "", ""


def _abandon(proc: subprocess.Popen[str]) -> None:
    """Stop waiting for ``proc``: close our ends of its pipes and reap it in the background (a
    process stuck in the kernel exits when it leaves it; until then it is not our caller's wait)."""
    for pipe in (proc.stdin, proc.stdout, proc.stderr):
        if pipe is not None:
            with contextlib.suppress(OSError, ValueError):
                pipe.close()
    threading.Thread(target=proc.wait, name="hpclaunch-reap", daemon=True).start()
