"""What went wrong with a checkpoint, in the user's words, and the test hooks that make it go wrong.

DCP wraps a rank's failure in a ``CheckpointException`` that carries every rank's exception with
its traceback. ``save_error`` digs out the operating-system error underneath and says it the way a
user can act on it: "no space left on /x/checkpoints: 12.0 MiB free, the checkpoint needs about
230.0 MiB", "permission denied: cannot write /x/checkpoints/...". Every rank gets the same
CheckpointException from DCP, so every rank raises the same message, whatever the rank count.

Test hooks (environment variables, read at call time; never set them in production):

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
import shutil
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ...errors import CheckpointError
from ...fsutil import human_bytes

log = logging.getLogger("hpclaunch.trainer.checkpoint")

ENV_DELAY_WRITE = "HPCLAUNCH_TEST_CKPT_DELAY_WRITE_S"
ENV_KILL = "HPCLAUNCH_TEST_CKPT_KILL"
ENV_FAIL = "HPCLAUNCH_TEST_CKPT_FAIL"
ENV_SNAPSHOT_DELAY_COPY = "HPCLAUNCH_TEST_SNAPSHOT_DELAY_COPY_S"

_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
_DENIED = (errno.EACCES, errno.EPERM)


def _causes(exc: BaseException) -> Iterator[BaseException]:
    """``exc``, what it wraps (DCP's per-rank failures) and its causes, depth first."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            for _, pair in sorted(failures.items()):
                inner = pair[0] if isinstance(pair, tuple) else pair
                if isinstance(inner, BaseException):
                    todo.append(inner)
        for nxt in (e.__cause__, e.__context__):
            if nxt is not None:
                todo.append(nxt)


def os_error(exc: BaseException) -> OSError | None:
    """The first OSError with an errno inside ``exc`` (None when the failure was not the OS's)."""
    for e in _causes(exc):
        if isinstance(e, OSError) and e.errno is not None:
            return e
    return None


def is_filesystem_failure(exc: BaseException, *, directory: Path, needed_bytes: int | None) -> bool:
    """The save failed for the filesystem's reasons (full, denied, read-only), not a peer's death."""
    oserr = os_error(exc)
    if oserr is not None:
        return oserr.errno in (*_NO_SPACE, *_DENIED, errno.EROFS)
    try:
        return needed_bytes is not None and shutil.disk_usage(directory).free < needed_bytes
    except OSError:
        return False


def save_error(
    exc: BaseException, *, directory: Path, step: int, needed_bytes: int | None
) -> CheckpointError:
    """One CheckpointError in the user's words for a save of ``step`` into ``directory`` that failed."""
    if isinstance(exc, CheckpointError) and exc.hint:
        return exc
    oserr = os_error(exc)
    try:
        free: int | None = shutil.disk_usage(directory).free
    except OSError:
        free = None
    # torch's zip writer sometimes reports a full disk as "unexpected pos ..." without the errno:
    # then the filesystem itself says what happened.
    full = free is not None and needed_bytes is not None and free < needed_bytes
    if (oserr is not None and oserr.errno in _NO_SPACE) or (oserr is None and full):
        need = f", the checkpoint needs about {human_bytes(needed_bytes)}" if needed_bytes else ""
        free_text = human_bytes(free) if free is not None else "unknown"
        return CheckpointError(
            f"no space left on {directory}: {free_text} free{need} (saving step {step})",
            hint="free space there, lower checkpoint.keep_last, or set checkpoint.dir to a larger "
            "filesystem; then resume: the last good checkpoint is kept",
        )
    if oserr is not None and oserr.errno in _DENIED:
        where = oserr.filename or directory
        return CheckpointError(
            f"permission denied: cannot write {where} (saving step {step})",
            hint=f"make {directory} writable for this user, or set checkpoint.dir; then resume",
        )
    if oserr is not None and oserr.errno == errno.EROFS:
        return CheckpointError(
            f"read-only filesystem: cannot write {oserr.filename or directory} (saving step {step})",
            hint="set checkpoint.dir to a writable filesystem; then resume",
        )
    return as_checkpoint_error(exc, f"writing step {step}", directory)


def as_checkpoint_error(exc: BaseException, what: str, where: Path) -> CheckpointError:
    """One CheckpointError from whatever DCP raised (it wraps per-rank errors)."""
    if isinstance(exc, CheckpointError):
        return exc
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = [(rank, pair[0]) for rank, pair in sorted(failures.items())]
        for _, err in inner:
            if isinstance(err, CheckpointError):
                return err
        err = inner[0][1]
        ranks = ",".join(str(r) for r, _ in inner)
        first = str(err).splitlines()[0] if str(err) else ""
        return CheckpointError(
            f"{what} failed on rank(s) {ranks}: {type(err).__name__}: {first}", where=str(where)
        )
    first = str(exc).splitlines()[0] if str(exc) else ""
    return CheckpointError(f"{what} failed: {type(exc).__name__}: {first}", where=str(where))


def estimated_bytes(state: Any, world_size: int, rank_local_key: str) -> int:
    """About how many bytes a checkpoint of ``state`` takes on disk, summed over all ranks, computed
    on one rank without a collective: a sharded tensor counts at its global size, a replicated one
    once, rank-local state once per rank."""
    from ..state import is_dtensor

    def walk(obj: Any, per_rank: bool) -> int:
        if isinstance(obj, dict):
            return sum(walk(v, per_rank or k == rank_local_key) for k, v in obj.items())
        if isinstance(obj, (list, tuple)):
            return sum(walk(v, per_rank) for v in obj)
        nbytes = 0
        if is_dtensor(obj):
            nbytes = obj.numel() * obj.element_size()  # global shape
        elif hasattr(obj, "element_size") and hasattr(obj, "numel"):
            nbytes = obj.numel() * obj.element_size()
        return nbytes * (world_size if per_rank else 1)

    return walk(state, False)


# ---- test hooks -----------------------------------------------------------------------------------


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
