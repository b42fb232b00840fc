"""Real parts for the memory tier's tests: a small tmpfs that fills up (mounted with the mount(2)
system call, no process started), and another user of the same node (a real uid, where the test
runs as root). Each skips with its reason where the machine does not allow it."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import pwd
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

MNT_DETACH = 2


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


@contextmanager
def small_tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` (mount's syntax: "1m") at ``path``, unmounted afterwards; skips the test
    where mounting is not allowed (not root, no CAP_SYS_ADMIN in this container)."""
    path.mkdir(parents=True, exist_ok=True)
    libc = _libc()
    if libc.mount(b"tmpfs", str(path).encode(), b"tmpfs", 0, f"size={size},mode=1777".encode()) != 0:
        err = ctypes.get_errno()
        pytest.skip(f"cannot mount a tmpfs here ({os.strerror(err)}): a full tmpfs needs one")
    try:
        yield path
    finally:
        libc.umount2(str(path).encode(), MNT_DETACH)


def other_user() -> tuple[int, int]:
    """(uid, gid) of another user of this node to act as; skips where the test cannot switch to one."""
    if os.geteuid() != 0:
        pytest.skip("acting as another user needs root")
    try:
        pw = pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no user 'nobody' on this machine to act as")
    return pw.pw_uid, pw.pw_gid
