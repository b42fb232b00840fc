"""Test hooks that make a save go wrong on purpose: delays, kills and injected write errors.

Production modules call them at the points where a real fault could strike (the writer, the
snapshot transfer); each does nothing unless its environment variable is set, and the variables are
read at call time. Never set them in production. Kept apart from ``save_errors`` (the user-facing
words for real failures) so that what a user reads and what a test breaks have one home each.

``HPCLAUNCH_TEST_CKPT_DELAY_WRITE_S=<seconds>[:writer]``
    the writer sleeps this long before writing a save (proves that staging copied the state);
    with ``:writer``, only a writer process does (background saves; a blocking save does not).
``HPCLAUNCH_TEST_CKPT_KILL=[>=]<step>:<rank>:<phase>[:writer]``
    rank ``<rank>`` is SIGKILLed while saving ``<step>`` (``>=``: the first save of that step or a
    later one, for saves that a loaded machine may skip, such as memory snapshots); phase ``data``: after its own data
    files are written, before ``.metadata``; phase ``publish``: after ``.metadata``, before
    ``manifest.json`` and the rename. Simulates ``kill -9`` in the middle of a checkpoint. The
    training process dies (under the process writer, its writer kills it at that point and dies
    with it); with the suffix ``:writer``, only the writer process dies (under the thread writer,
    writer and rank are one process).
``HPCLAUNCH_TEST_SNAPSHOT_DELAY_COPY_S=<seconds>``
    a memory-tier snapshot's job sleeps this long before its staging copies (the copies a training
    step must not race: the optimizer's update, an evaluation's EMA swap, a close).
``HPCLAUNCH_TEST_CKPT_FAIL=<errno name>@<step>[+][:<rank>]``
    DCP's filesystem writer raises that ``OSError`` (e.g. ``ENOSPC``, ``EACCES``) when it writes
    step ``<step>`` (``+``: and every later step) on ``<rank>`` (default: every rank): a disk that
    fills up, or a directory that loses its permissions, without needing either.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger("hpclaunch.rank.checkpoint")

ENV_DELAY_WRITE = "HPCLAUNCH_TEST_CKPT_DELAY_WRITE_S"
ENV_KILL = "HPCLAUNCH_TEST_CKPT_KILL"
ENV_FAIL = "HPCLAUNCH_TEST_CKPT_FAIL"
ENV_SNAPSHOT_DELAY_COPY = "HPCLAUNCH_TEST_SNAPSHOT_DELAY_COPY_S"


def delay_write_hook(*, in_writer_process: bool = False) -> None:
    value = os.environ.get(ENV_DELAY_WRITE, "")
    seconds, writer_only = value.removesuffix(":writer"), value.endswith(":writer")
    if seconds and (in_writer_process or not writer_only):
        time.sleep(float(seconds))


def kill_requested(step: int, rank: int, phase: str) -> bool:
    spec = os.environ.get(ENV_KILL, "").removesuffix(":writer")
    if spec.startswith(">="):
        at, sep, rest = spec[2:].partition(":")
        return bool(sep) and at.isdigit() and step >= int(at) and rest == f"{rank}:{phase}"
    return spec == f"{step}:{rank}:{phase}"


def snapshot_copy_delay_hook() -> None:
    """Sleep as ``ENV_SNAPSHOT_DELAY_COPY`` asks before a snapshot's staging copies (see the module)."""
    delay = os.environ.get(ENV_SNAPSHOT_DELAY_COPY, "")
    if delay:
        time.sleep(float(delay))


def kill_hook(step: int, rank: int, phase: str, *, in_writer_process: bool = False) -> None:
    """SIGKILL what ``ENV_KILL`` names at this point of the save (see the module docstring)."""
    if not kill_requested(step, rank, phase):
        return
    writer_only = os.environ.get(ENV_KILL, "").endswith(":writer")
    victim = "its writer process" if writer_only and in_writer_process else f"rank {rank}"
    log.warning("test hook %s: kills %s (%s phase of step %d)", ENV_KILL, victim, phase, step)
    logging.shutdown()
    if in_writer_process and not writer_only:
        # The training process first; this writer dies with it (parent-death signal), and must not
        # write on in the meantime.
        os.kill(os.getppid(), signal.SIGKILL)
        while True:
            signal.pause()
    os.kill(os.getpid(), signal.SIGKILL)


def injected_failure(step: int, rank: int) -> int | None:
    """The errno ``ENV_FAIL`` asks this rank to fail the write of ``step`` with (None: no failure)."""
    spec = os.environ.get(ENV_FAIL, "").strip()
    if not spec:
        return None
    name, _, rest = spec.partition("@")
    at, _, who = rest.partition(":")
    onwards = at.endswith("+")
    target = int(at.rstrip("+"))
    if who and int(who) != rank:
        return None
    if step == target or (onwards and step > target):
        return int(getattr(errno, name.upper()))
    return None


@functools.cache
def hooked_writer_class() -> type[Any]:
    """Test-only DCP writer: fails with an injected OSError (``ENV_FAIL``) or SIGKILLs this rank after
    its data files are written (``ENV_KILL``)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
    from torch.distributed.checkpoint.storage import WriteResult
    from torch.futures import Future as TorchFuture

    class HookedWriter(dcp.FileSystemWriter):
        def __init__(self, path: Path, fail_errno: int | None, on_data_written: Callable[[], None]) -> None:
            super().__init__(path, sync_files=True, overwrite=False)
            self.fail_errno = fail_errno
            self.on_data_written = on_data_written
            self.where = Path(path)

        def write_data(self, plan: SavePlan, planner: SavePlanner) -> TorchFuture[list[WriteResult]]:
            if self.fail_errno is not None:
                raise OSError(self.fail_errno, os.strerror(self.fail_errno), str(self.where))
            fut = super().write_data(plan, planner)
            fut.wait()
            self.on_data_written()
            return fut

    return HookedWriter
