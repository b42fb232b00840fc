"""One node's snapshot files: ``<allocation dir>/step-<step>-w<world>/rank-<r>.bin`` and ``.json``
(the allocation's directory and the private root above it: ``rundir.shm``).

A shard's space is reserved before a byte is written (``posix_fallocate``: on a full tmpfs it fails at
once with ENOSPC, where a file sized with ``ftruncate`` is sparse and a write into its mapping dies of
SIGBUS or, received into by gloo, never completes). Files are made with ``O_EXCL | O_NOFOLLOW``, 0600,
in directories checked to be this user's own. A shard is written under temporary names and published
by two renames, the payload first and its description (``.json``) last: a description names its
payload's size and checksum, and only a shard whose description exists and whose payload has that
size is held; the checksum is checked before a restore uses it. So a rank killed while writing or
receiving leaves temporary files that nothing reads (removed with the step's directory).

The directory is named after the node (the scheduler's name for it), so that nodes that share a
``/dev/shm`` (the local test clusters) still keep apart what each holds: a node reads only its own.
"""

from __future__ import annotations

import contextlib
import errno
import json
import mmap
import os
import re
import stat
from collections.abc import Mapping
from pathlib import Path

from ...rundir.shm import Hold, TierPlaceError, allocation_dir, check_private, remove_tree

_STEP_DIR = re.compile(r"^step-(\d+)-w(\d+)$")
_SHARD = re.compile(r"^rank-(\d+)\.json$")
_NEW = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC


class NoRoom(OSError):
    """The tmpfs has no room for a shard: said in the user's words."""

    def __str__(self) -> str:
        return self.strerror or super().__str__()


def mount_of(path: Path) -> Path:
    """The mount point ``path`` lies on (what a user knows the tmpfs by: /dev/shm)."""
    dev = os.stat(path).st_dev
    while path.parent != path and os.stat(path.parent).st_dev == dev:
        path = path.parent
    return path


def human(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


def _new_file(path: Path) -> int:
    """A new private file at ``path`` (a stale one of the same name, left by a killed rank, is
    removed first: the directory is this user's own)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    return os.open(path, _NEW, 0o600)


def reserve(fd: int, nbytes: int, where: Path) -> None:
    """Allocate ``nbytes`` for ``fd`` now, or raise ``NoRoom`` saying how much the tmpfs has."""
    if nbytes <= 0:
        return
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        try:
            st = os.statvfs(where)
            free = f"{human(st.f_bavail * st.f_frsize)} free of {human(st.f_blocks * st.f_frsize)}"
            where = mount_of(where)
        except OSError:
            free = "its free space unknown"
        raise NoRoom(
            e.errno, f"no room for a snapshot shard of {human(nbytes)} in {where} ({free})"
        ) from None


def private_subdir(d: Path) -> Path:
    with contextlib.suppress(FileExistsError):
        os.mkdir(d, 0o700)
    check_private(d)
    return d


class PendingShard:
    """One shard being written: its space reserved, its payload mapped for writing, published or dropped."""

    def __init__(self, directory: Path, rank: int, nbytes: int) -> None:
        self.directory = private_subdir(directory)
        self.rank = rank
        self.nbytes = nbytes
        self._bin_tmp = directory / f".rank-{rank:05d}.bin.tmp"
        self._json_tmp = directory / f".rank-{rank:05d}.json.tmp"
        self._mm: mmap.mmap | None = None
        self._fd = _new_file(self._bin_tmp)
        try:
            reserve(self._fd, nbytes, directory)
        except BaseException:
            self.drop()
            raise

    def payload(self) -> memoryview:
        """The payload's bytes, mapped (to receive into, or to send from)."""
        if self._mm is None:
            self._mm = mmap.mmap(self._fd, max(self.nbytes, 1))
        return memoryview(self._mm)[: self.nbytes]

    def copy_from_fd(self, fd: int) -> None:
        """The payload from another file (the staging buffer's memfd), in the kernel."""
        done = 0
        while done < self.nbytes:
            n = os.sendfile(self._fd, fd, done, self.nbytes - done)
            if n == 0:
                raise OSError(f"short copy of a snapshot: {done} of {self.nbytes} bytes")
            done += n

    def publish(self, meta: bytes) -> None:
        """The description, then both renames (the description last: it makes the shard held)."""
        self._release()
        fd = _new_file(self._json_tmp)
        with os.fdopen(fd, "wb") as f:
            f.write(meta)
        os.replace(self._bin_tmp, self.directory / f"rank-{self.rank:05d}.bin")
        os.replace(self._json_tmp, self.directory / f"rank-{self.rank:05d}.json")

    def drop(self) -> None:
        self._release()
        for p in (self._bin_tmp, self._json_tmp):
            with contextlib.suppress(OSError):
                p.unlink()

    def _release(self) -> None:
        if self._mm is not None:
            with contextlib.suppress(BufferError):
                self._mm.close()
            self._mm = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class HeldShard:
    """A published shard opened for a restore: its description, and its payload mapped read-only
    (the tmpfs's own pages: reading or sending it copies nothing)."""

    def __init__(self, directory: Path, rank: int) -> None:
        with open(os.open(directory / f"rank-{rank:05d}.json", _READ), "rb") as f:
            self.meta = f.read()
        fd = os.open(directory / f"rank-{rank:05d}.bin", _READ)
        try:
            size = os.fstat(fd).st_size
            self._mm = mmap.mmap(fd, size, prot=mmap.PROT_READ) if size else None
        finally:
            os.close(fd)

    def payload(self) -> memoryview:
        return memoryview(self._mm) if self._mm is not None else memoryview(b"")

    def close(self) -> None:
        if self._mm is not None:
            with contextlib.suppress(BufferError):  # (a view still held elsewhere: GC frees it)
                self._mm.close()
            self._mm = None


class NodeStore:
    """What this node holds for this allocation (job id and the scheduler's restart count), under
    ``root/node/alloc-<id>``, held (``rundir.shm.Hold``) while the store is open. Memory does not
    outlive an allocation: what an earlier allocation of the run left on the node (a requeue, a
    continuation job) is never read, the disk serves, and the node agent's sweep frees it."""

    def __init__(self, root: Path, base: Path, node: str, allocation: str | None) -> None:
        self.root = root
        self.node = node
        self.directory = allocation_dir(root, node, allocation)
        self._hold: Hold | None = Hold(self.directory, base)

    def step_dir(self, step: int, world: int) -> Path:
        return self.directory / f"step-{step:08d}-w{world}"

    def begin(self, step: int, world: int, rank: int, nbytes: int) -> PendingShard:
        check_private(self.directory)
        return PendingShard(self.step_dir(step, world), rank, nbytes)

    def holdings(self) -> dict[int, dict[int, dict[int, tuple[int, int]]]]:
        """step -> world -> rank -> (payload bytes, description bytes) of every published shard whose
        payload has the size its description names (a shard cut short is not held)."""
        out: dict[int, dict[int, dict[int, tuple[int, int]]]] = {}
        for step, world, d in self._step_dirs():
            for meta_path in d.iterdir():
                m = _SHARD.match(meta_path.name)
                if m is None:
                    continue
                rank = int(m.group(1))
                try:
                    with open(os.open(meta_path, _READ), "rb") as f:
                        text = f.read()
                    nbytes = int(json.loads(text)["nbytes"])
                    payload = os.lstat(d / f"rank-{rank:05d}.bin")
                    if not stat.S_ISREG(payload.st_mode) or payload.st_size != nbytes:
                        continue
                except (OSError, ValueError, KeyError, TypeError):
                    continue
                out.setdefault(step, {}).setdefault(world, {})[rank] = (nbytes, len(text))
        return out

    def open(self, step: int, world: int, rank: int) -> HeldShard:
        """A held shard, for a restore (``HeldShard.close`` when done)."""
        check_private(self.directory)
        return HeldShard(self.step_dir(step, world), rank)

    def prune(self, ranks: list[int], keep_last: int, step: int) -> None:
        """Remove ``ranks``' shards beyond the newest ``keep_last`` steps up to ``step`` (the one just
        written), and every one newer than it: those are of a timeline the run left (it resumed from
        an older step), and counted as newest they would make each new snapshot pruned at once. Each
        rank prunes what it wrote, so no two ranks remove the same file; step directories left
        empty go too."""
        dirs = sorted(self._step_dirs(), reverse=True)
        newer = [d for s, _, d in dirs if s > step]
        older = [d for s, _, d in dirs if s <= step]
        for d in newer + older[keep_last:]:
            self._remove_ranks(d, ranks)

    def forget_after(self, step: int | None) -> None:
        """At a resume from ``step`` (None: not from this tier, the disk or nothing): every snapshot
        newer is of the timeline the run left, and goes, whole directories and every rank's shard in
        them (this node's ranks' and their wards' copies) before any rank writes again. Left, a rank
        whose first snapshot of the new timeline failed kept the old one's shard of that step, and
        the next restore joined it to its peers' new ones (issue 49, L1)."""
        for s, _, d in self._step_dirs():
            if step is None or s > step:
                remove_tree(d)

    def _remove_ranks(self, d: Path, ranks: list[int]) -> None:
        for rank in ranks:  # (description first; and what a killed rank left half-written)
            for name in (
                f"rank-{rank:05d}.json",
                f"rank-{rank:05d}.bin",
                f".rank-{rank:05d}.json.tmp",
                f".rank-{rank:05d}.bin.tmp",
            ):
                with contextlib.suppress(OSError):
                    (d / name).unlink()
        with contextlib.suppress(OSError):
            d.rmdir()

    def close(self, *, remove: bool) -> None:
        """Let go of the allocation's directory; ``remove``: free it too (the run's last save is on
        disk), with the node's and the run's directories when they are left empty."""
        if self._hold is None:
            return
        if remove:
            self._hold.free()
        else:
            self._hold.release()
        self._hold = None

    def _step_dirs(self) -> list[tuple[int, int, Path]]:
        try:
            entries = list(self.directory.iterdir())
        except OSError:
            return []
        found = []
        for d in entries:
            m = _STEP_DIR.match(d.name)
            if m is not None and stat.S_ISDIR(os.lstat(d).st_mode):
                found.append((int(m.group(1)), int(m.group(2)), d))
        return found


def describe_json(meta: Mapping[str, object]) -> bytes:
    return json.dumps(meta, sort_keys=True, separators=(",", ":")).encode()


__all__ = [
    "HeldShard",
    "NoRoom",
    "NodeStore",
    "PendingShard",
    "TierPlaceError",
    "describe_json",
    "remove_tree",
]
