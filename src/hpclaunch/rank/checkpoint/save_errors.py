"""What went wrong with a checkpoint, in the user's words.

DCP wraps a rank's failure in a ``CheckpointException`` that carries every rank's exception with
its traceback. ``save_error`` digs out the operating-system error underneath and says it the way a
user can act on it: "no space left on /x/checkpoints: 12.0 MiB free, the checkpoint needs about
230.0 MiB", "permission denied: cannot write /x/checkpoints/...". Every rank gets the same
CheckpointException from DCP, so every rank raises the same message, whatever the rank count.

The test hooks that make saves go wrong on purpose live in ``fault_hooks``.
"""

from __future__ import annotations

import errno
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ...errors import CheckpointError
from ...fsutil import human_bytes

log = logging.getLogger("hpclaunch.rank.checkpoint")


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
    from ..tensors import is_dtensor

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
