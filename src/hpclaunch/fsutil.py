"""Small durable-file helpers: atomic replace, directory fsync, append-one-line; how sizes are shown."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeAlias, TypeVar

T = TypeVar("T")

# A JSON value as ``json.loads`` returns it, for what is truly arbitrary JSON (a config dump, a line
# passed through unread). A record whose keys are known gets its own type (a TypedDict, a dataclass).
JSONValue: TypeAlias = "str | int | float | bool | list[JSONValue] | dict[str, JSONValue] | None"
JSONObject: TypeAlias = "dict[str, JSONValue]"

# Read errors that say "cannot read now" rather than "the content is bad": a network filesystem's
# hiccup (EIO, ESTALE), a permission that flickers while a ticket or an ACL is renewed (EACCES,
# EPERM), an interrupted or busy call. Never evidence that a file is corrupt.
TRANSIENT_ERRNOS = frozenset(
    {
        errno.EIO,
        errno.ESTALE,
        errno.EACCES,
        errno.EPERM,
        errno.EAGAIN,
        errno.EINTR,
        errno.EBUSY,
        errno.ETIMEDOUT,
    }
)


def fsync_dir(path: Path) -> None:
    """Make a rename/creation inside ``path`` durable (POSIX: fsync the directory)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_text(path: Path, text: str, *, mode: int | None = None) -> None:
    """Write ``text`` to ``path`` so that readers see either the old or the whole new file."""
    atomic_write_bytes(path, text.encode(), mode=mode)


def atomic_write_bytes(path: Path, data: bytes, *, mode: int | None = None) -> None:
    """Write ``data`` to ``path`` so that readers see either the old or the whole new file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.{unique_suffix()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    if mode is not None:
        os.chmod(tmp, mode)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def take_aside(path: Path, aside: Path) -> bool:
    """Rename ``path`` to ``aside``; False when it was already gone. A rename is atomic, so of
    several processes taking the same path only one gets what was there."""
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return False
    return True


def unique_suffix() -> str:
    """A temporary name's suffix no other process on any host shares (pids repeat across hosts)."""
    return f"{socket.gethostname().split('.')[0]}.{os.getpid()}.{uuid.uuid4().hex[:8]}"


def retry_transient(
    read: Callable[[], T], *, attempts: int = 5, first_delay_s: float = 0.2, max_delay_s: float = 60.0
) -> T:
    """``read()``, retried with a growing pause (at most ``max_delay_s``) while it fails with a
    transient ``OSError`` (see ``TRANSIENT_ERRNOS``); the last such error is raised. Other errors
    pass through at once."""
    delay = first_delay_s
    for i in range(attempts):
        try:
            return read()
        except OSError as e:
            if e.errno not in TRANSIENT_ERRNOS or i == attempts - 1:
                raise
        time.sleep(delay)
        delay = min(2 * delay, max_delay_s)
    raise AssertionError("unreachable")


def retry_patiently(write: Callable[[], T]) -> T:
    """``write()`` that the control plane cannot do without (a node's report, its check's verdict,
    a decision): transient errors retried for about 20 s (12 tries, pauses up to 2 s)."""
    return retry_transient(write, attempts=12, max_delay_s=2.0)


# What a poll makes of a transient error: read again a few times (about 0.6 s), then "not yet" (the
# next poll reads again). A control-plane read must never end the agent that polls.
POLL_ATTEMPTS = 3


def poll_json(path: Path, *, attempts: int = POLL_ATTEMPTS) -> Any | None:
    """The JSON in ``path`` as a poll sees it: None while it is absent, half-written or unreadable
    for now (a transient error read again ``attempts`` times first: NFS's ESTALE after a server
    restart, EIO); never raises for those."""
    try:
        return json.loads(retry_transient(Path(path).read_text, attempts=attempts))
    except (FileNotFoundError, NotADirectoryError, ValueError):
        return None
    except OSError as e:
        if e.errno in TRANSIENT_ERRNOS:
            return None
        raise


def poll_exists(path: Path, *, attempts: int = POLL_ATTEMPTS) -> bool:
    """Whether ``path`` exists, as a poll sees it: a transient error read again, then "not yet"."""
    try:
        retry_transient(lambda: os.stat(path), attempts=attempts)
        return True
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError as e:
        if e.errno in TRANSIENT_ERRNOS:
            return False
        raise


def create_exclusive(path: Path, text: str) -> bool:
    """Create ``path`` holding ``text`` unless it exists; False when it does. ``link()`` of a fully
    written temporary file: atomic, and exclusive over NFS too (where O_EXCL was not always)."""
    retry_transient(lambda: path.parent.mkdir(parents=True, exist_ok=True))
    tmp = path.with_name(f".{path.name}.{unique_suffix()}")
    retry_transient(lambda: tmp.write_text(text))
    try:
        # A LINK that failed with ESTALE or EIO may still have been made on the server: the retry
        # then gets EEXIST for our own link, which ``_linked_anyway`` recognises.
        retry_transient(lambda: os.link(tmp, path))
        return True
    except FileExistsError:
        return _linked_anyway(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


def _linked_anyway(tmp: Path, path: Path) -> bool:
    """After EEXIST: whether ``path`` is our own ``tmp`` after all. An NFS client that retransmits
    a LINK whose reply was lost gets EEXIST for the link its first call made; the server then holds
    two names for our file. The usual check (as NFS-safe lock files do): the temporary file's link
    count, or ``path`` naming the same inode (a count can lag in the attribute cache; the lookup of
    ``path`` after the failed LINK is fresh)."""
    try:
        mine = os.stat(tmp)
        theirs = os.stat(path)
    except FileNotFoundError:
        return False  # the existing file went again meanwhile: not ours; the caller reads again
    return mine.st_nlink == 2 or (mine.st_ino, mine.st_dev) == (theirs.st_ino, theirs.st_dev)


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def append_line(path: Path, line: str) -> None:
    """Append one line with a single O_APPEND write (concurrent writers never interleave a line)."""
    data = (line.rstrip("\n") + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """All complete JSON lines of ``path``; a torn last line (writer killed) is ignored."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return []
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict):
            out.append(obj)
    return out


def human_bytes(n: float) -> str:
    """``1.5 GiB``-style size (binary units): the one way sizes are shown to users."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
