"""The memory tier's place in a node's shared memory (``checkpoint.memory``), without torch: the
trainer's snapshots live there, the node agent frees and sweeps it.

    <dir>/hpclaunch-<uid>/<run id>/<node>/alloc-<allocation>/step-<step>-w<world>/rank-<r>.bin|.json

``<dir>`` is ``checkpoint.memory.dir`` (a tmpfs; default ``/dev/shm``) and is never created here: a
typo must not make directories at the filesystem root. Under it each user has a root of their own,
made 0700 by that user and checked with ``lstat`` at every use (a directory, not a link, owned by
this user, private): another user can neither read a snapshot nor plant one, and a root made by
the first user of a shared node no longer locks the others out. ``<run id>`` hashes the run
directory, so runs that share a ``dir`` keep apart.

Memory does not outlive an allocation. An allocation's directory is *held* (a shared ``flock`` of its
``.held`` file) by the node agent for as long as the run may restart in place on the node, and by
every rank while its tier is open; the lock dies with its process, SIGKILL included. A directory
that nobody holds was left by an allocation that ended (cancelled, failed, requeued, its node
taken away): ``sweep`` frees this user's at a node agent's start, and ``free`` frees the agent's own
when the run does not restart in place on its node.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import shutil
import stat
import time
from collections.abc import Iterator
from pathlib import Path

from ..config import MemoryTierConfig
from ..errors import UserInputError
from .paths import RunPaths

DEFAULT_BASE = Path("/dev/shm")
HELD = ".held"
# A directory without a ``.held`` file younger than this may be a hold being made (mkdir, then the
# lock): left alone; older, it was left by a process killed in between.
UNHELD_GRACE_S = 60.0
_MAKE_TRIES = 5


class TierPlaceError(UserInputError):
    """A per-user node-local directory cannot be used (missing, not private, another user's): the
    memory tier's, the ranks' progress heartbeats' (``jobs.node_progress``), the compile cache's."""


def base_of(memory: MemoryTierConfig) -> Path:
    """The tmpfs the tier's per-user root is made in (``checkpoint.memory.dir``)."""
    return Path(memory.dir) if memory.dir else DEFAULT_BASE


def user_root(base: Path) -> Path:
    return base / f"hpclaunch-{os.getuid()}"


def run_id(paths: RunPaths) -> str:
    return hashlib.sha256(str(paths.root.resolve()).encode()).hexdigest()[:16]


def run_root(memory: MemoryTierConfig, paths: RunPaths) -> Path:
    """Where this run's snapshots live on every node (one directory per node below it)."""
    return user_root(base_of(memory)) / run_id(paths)


def safe_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name) or "_"


def allocation_dir(root: Path, node: str, allocation: str | None) -> Path:
    return root / safe_name(node) / f"alloc-{safe_name(allocation or 'unknown')}"


def check_private(path: Path) -> None:
    """``path`` is a directory (not a link) owned by this user that nobody else may enter."""
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise TierPlaceError(f"{path} is not a directory (a link or a file is in its place)")
    if st.st_uid != os.getuid():
        raise TierPlaceError(f"{path} belongs to user id {st.st_uid}, not to this user ({os.getuid()})")
    if st.st_mode & 0o077:
        raise TierPlaceError(
            f"{path} is open to other users (mode {stat.S_IMODE(st.st_mode):o}, not 700)",
            hint=f"remove it (rm -r {path}) or make it private (chmod 700 {path})",
        )


def _close_own(path: Path) -> None:
    """``path``, this user's real directory, made 0700 where an older version left it open."""
    with contextlib.suppress(OSError):
        st = os.lstat(path)
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and st.st_mode & 0o077:
            os.chmod(path, 0o700)


def private_dirs(leaf: Path, base: Path, *, root: Path | None = None) -> Path:
    """Make ``leaf`` and every directory between ``root`` (``base``'s user root by default) and it,
    0700, each checked; the base must exist already. Retried when a sweep removes a directory on the
    way meanwhile."""
    root = user_root(base) if root is None else root
    if not base.is_dir():
        raise TierPlaceError(
            f"{base} does not exist (checkpoint.memory.dir names the node's tmpfs; it is never created)",
            hint="set checkpoint.memory.dir to an existing tmpfs such as /dev/shm, or null",
        )
    chain = [root, *reversed([p for p in leaf.parents if root in p.parents]), leaf]
    for attempt in range(_MAKE_TRIES):
        try:
            for d in chain:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(d, 0o700)
                if d != root:
                    _close_own(d)  # (below a private root nobody else got in: an older mode is fixed)
                check_private(d)
            return leaf
        except FileNotFoundError:  # a sweep removed one on the way: make the chain again
            if attempt == _MAKE_TRIES - 1:
                raise
    return leaf


class Hold:
    """A shared lock on an allocation's directory: while a hold is open, no sweep removes it."""

    def __init__(self, directory: Path, base: Path) -> None:
        self.directory = directory
        for _ in range(_MAKE_TRIES):
            private_dirs(directory, base)
            fd = os.open(directory / HELD, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            fcntl.flock(fd, fcntl.LOCK_SH)
            # a sweep that took the directory just before holds the old file: make it again
            with contextlib.suppress(FileNotFoundError):
                if os.stat(directory / HELD, follow_symlinks=False).st_ino == os.fstat(fd).st_ino:
                    self._fd = fd
                    return
            os.close(fd)
        raise TierPlaceError(f"{directory} keeps being removed while it is made")

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def free(self) -> None:
        """Remove the directory (its owner is done with it) and release the hold."""
        remove_tree(self.directory)
        self.release()


def remove_tree(directory: Path) -> None:
    """Rename ``directory`` out of the way first (a hold being made then makes a new one), then
    remove it, and its node's and run's directories when they are left empty."""
    gone = directory.with_name(f".gone-{directory.name}-{os.getpid()}-{time.monotonic_ns()}")
    try:
        os.rename(directory, gone)
    except OSError:
        return
    shutil.rmtree(gone, ignore_errors=True)
    for parent in (directory.parent, directory.parent.parent):
        with contextlib.suppress(OSError):
            parent.rmdir()


def _allocation_dirs(root: Path) -> Iterator[Path]:
    for run in _entries(root):
        for node in _entries(run):
            for d in _entries(node):
                if d.name.startswith("alloc-") or d.name.startswith(".gone-"):
                    yield d


def _entries(d: Path) -> list[Path]:
    try:
        return [p for p in d.iterdir() if stat.S_ISDIR(os.lstat(p).st_mode)]
    except OSError:
        return []


def sweep(base: Path, node_dir: Path | None = None) -> list[Path]:
    """Free what ended allocations of this user left under ``base`` (no process holds it), or only
    under ``node_dir`` (one run's one node); the directories removed. Another user's root is never
    entered; this user's is checked first."""
    root = user_root(base)
    try:
        check_private(root)
    except (OSError, TierPlaceError):
        return []
    removed = []
    found = _allocation_dirs(root) if node_dir is None else iter(_entries(node_dir))
    for d in found:
        if not (d.name.startswith("alloc-") or d.name.startswith(".gone-")):
            continue
        if d.name.startswith(".gone-"):  # (a removal cut short)
            shutil.rmtree(d, ignore_errors=True)
            continue
        lock = _take_unheld(d)
        if lock is None:
            continue
        try:  # renamed while the lock is taken: a hold waiting for it then finds no file and remakes
            remove_tree(d)
        finally:
            if lock >= 0:
                os.close(lock)
        removed.append(d)
    for run in _entries(root):
        for node in _entries(run):
            with contextlib.suppress(OSError):
                node.rmdir()
        with contextlib.suppress(OSError):
            run.rmdir()
    return removed


def _take_unheld(directory: Path) -> int | None:
    """The ``.held`` file locked exclusively when no process holds ``directory`` (-1: it has no such
    file and is older than the grace period), else None."""
    try:
        fd = os.open(directory / HELD, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        with contextlib.suppress(OSError):
            if time.time() - os.lstat(directory).st_mtime > UNHELD_GRACE_S:
                return -1
        return None
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd
