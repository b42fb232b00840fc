"""A counting layer for the control plane's filesystem operations (used by ``bench/recovery.py
--scenario agree`` and its unit test). It counts, it never changes what a call does.

While a ``Counter`` is active, the os-level calls that hpclaunch's coordination code makes are
wrapped; a call on a path under ``root`` (or on a descriptor opened under it) is counted for the
agent that the calling thread is tagged with (``Counter.tag``; untagged threads are not counted).

What counts as what, on a shared filesystem (NFS, Lustre, GPFS):

- metadata operation: every call that names a path: ``stat``/``lstat`` (a lookup and a getattr),
  ``open`` (a lookup and an open; its ``close`` is counted with it), ``link``, ``rename``/``replace``,
  ``unlink``, ``mkdir``, ``utime``, ``chmod``, ``scandir``/``listdir`` (a readdir). A failed call
  counts too (a lookup of a missing ``end`` file costs the server as much as a found one).
- data operation: ``write``/``pwrite``/``fsync``/``fdatasync`` on a descriptor that was opened under
  ``root`` (they go to the data servers on Lustre/GPFS; on NFS, to the one server). Reading a file
  opened with ``open()`` is counted as one data operation per open.

``fstat`` and ``close`` are not counted separately (part of the open).

Faults: ``Counter.inject(errno, rate)`` makes that share of the counted path calls (``stat``,
``open`` and the like, by tagged threads) fail with ``errno`` before they reach the filesystem, as
an NFS client's ESTALE after a server restart does (``bench/control_plane_faults.py``).
"""

from __future__ import annotations

import builtins
import io
import os
import random
import threading
from collections import Counter as _Tally
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

PATH_CALLS = (
    "stat",
    "lstat",
    "link",
    "rename",
    "replace",
    "unlink",
    "mkdir",
    "utime",
    "chmod",
    "scandir",
    "listdir",
)
DATA_CALLS = ("write", "pwrite", "fsync", "fdatasync")


class Counter:
    """Metadata and data operations per agent tag, for paths under ``root``."""

    def __init__(self, root: os.PathLike[str] | str):
        self.root = os.path.abspath(os.fspath(root))
        self._local = threading.local()
        self._lock = threading.Lock()
        self.meta: _Tally[str] = _Tally()
        self.data: _Tally[str] = _Tally()
        self.calls: _Tally[tuple[str, str]] = _Tally()  # (tag, call): what the metadata ops were
        self._fds: set[int] = set()
        self._fail: tuple[int, float] | None = None  # (errno, share of the counted path calls)
        self._rng = random.Random(0)
        self.failed = 0

    def inject(self, err: int | None, rate: float = 0.0) -> None:
        """Make ``rate`` of the counted path calls fail with ``err`` from now on (None: stop)."""
        self._fail = (err, rate) if err is not None else None

    # ---- attribution -----------------------------------------------------------------------------

    def tag(self, name: str | None) -> None:
        """Count this thread's operations for ``name`` (None: not counted)."""
        self._local.tag = name

    def snapshot(self) -> tuple[dict[str, int], dict[str, int]]:
        with self._lock:
            return dict(self.meta), dict(self.data)

    def _under(self, path: Any) -> bool:
        try:
            p = os.fspath(path)
        except TypeError:
            return False
        if isinstance(p, bytes):
            p = p.decode(errors="replace")
        p = os.path.abspath(p)
        return p == self.root or p.startswith(self.root + os.sep)

    def _count(self, kind: str, call: str) -> None:
        tag = getattr(self._local, "tag", None)
        if tag is None:
            return
        with self._lock:
            if kind == "meta":
                self.meta[tag] += 1
                self.calls[(tag, call)] += 1
            else:
                self.data[tag] += 1
            fail = self._fail if kind == "meta" else None
            if fail is not None and self._rng.random() < fail[1]:
                self.failed += 1
                raise OSError(fail[0], os.strerror(fail[0]))

    # ---- the wrappers ----------------------------------------------------------------------------

    def _path_call(self, name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(path: Any = ".", *args: Any, **kwargs: Any) -> Any:
            if self._under(path):
                self._count("meta", name)
            return real(path, *args, **kwargs)

        return wrapped

    def _two_path_call(self, name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(src: Any, dst: Any, *args: Any, **kwargs: Any) -> Any:
            if self._under(src) or self._under(dst):
                self._count("meta", name)
            return real(src, dst, *args, **kwargs)

        return wrapped

    def _fd_call(self, name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(fd: int, *args: Any, **kwargs: Any) -> Any:
            if fd in self._fds:
                self._count("data", name)
            return real(fd, *args, **kwargs)

        return wrapped

    def _os_open(self, real: Callable[..., int]) -> Callable[..., int]:
        def wrapped(path: Any, *args: Any, **kwargs: Any) -> int:
            under = self._under(path)
            if under:
                self._count("meta", "open")
            fd = real(path, *args, **kwargs)
            if under:
                self._fds.add(fd)
            return fd

        return wrapped

    def _os_close(self, real: Callable[[int], None]) -> Callable[[int], None]:
        def wrapped(fd: int) -> None:
            self._fds.discard(fd)
            real(fd)

        return wrapped

    def _io_open(self, real: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(file: Any, *args: Any, **kwargs: Any) -> Any:
            under = not isinstance(file, int) and self._under(file)
            if under:
                self._count("meta", "open")
            f = real(file, *args, **kwargs)
            if under:
                self._count("data", "open")  # its read or write
            return f

        return wrapped

    @contextmanager
    def active(self) -> Iterator[Counter]:
        """Wrap the calls for the duration (process-wide: other threads run the wrappers too, and
        are counted only when tagged)."""
        saved: list[tuple[Any, str, Any]] = []

        def patch(obj: Any, name: str, new: Any) -> None:
            saved.append((obj, name, getattr(obj, name)))
            setattr(obj, name, new)

        for name in PATH_CALLS:
            real = getattr(os, name)
            if name in ("link", "rename", "replace"):
                patch(os, name, self._two_path_call(name, real))
            else:
                patch(os, name, self._path_call(name, real))
        for name in DATA_CALLS:
            patch(os, name, self._fd_call(name, getattr(os, name)))
        patch(os, "open", self._os_open(os.open))
        patch(os, "close", self._os_close(os.close))
        opener = self._io_open(io.open)
        patch(io, "open", opener)
        patch(builtins, "open", opener)
        try:
            yield self
        finally:
            for obj, name, real in reversed(saved):
                setattr(obj, name, real)
