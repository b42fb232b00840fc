"""One node's snapshot files: ``<root>/<node>/alloc-<id>/step-<step>-w<world>/rank-<r>.bin`` and
``.json``.

A shard is written under temporary names and published by two renames, the payload first and its
description (``.json``) last: a description names its payload's size, and only a shard whose
description exists and whose payload has that size is held. So a rank killed while writing or
receiving leaves temporary files that nothing reads (they are removed with the step's directory).

The directory is named after the node (the scheduler's name for it), so that nodes that share a
``/dev/shm`` (the local test clusters) still keep apart what each holds: a node reads only its own.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path

_STEP_DIR = re.compile(r"^step-(\d+)-w(\d+)$")
_SHARD = re.compile(r"^rank-(\d+)\.json$")


class PendingShard:
    """One shard being written: its payload mapped for writing, published or dropped."""

    def __init__(self, directory: Path, rank: int, nbytes: int) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.rank = rank
        self.nbytes = nbytes
        self._bin_tmp = directory / f".rank-{rank:05d}.bin.tmp"
        self._json_tmp = directory / f".rank-{rank:05d}.json.tmp"
        self._fd = os.open(self._bin_tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        os.ftruncate(self._fd, nbytes)
        self._mm: mmap.mmap | None = None

    def payload(self) -> memoryview:
        """The payload's bytes, mapped (to receive into, or to copy into)."""
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
        self._json_tmp.write_bytes(meta)
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


class NodeStore:
    """What this node holds for this allocation (job id and the scheduler's restart count), under
    ``root/node/alloc-<id>``. Memory does not outlive an allocation: what an earlier allocation of the
    run left on the node (a requeue, a continuation job) is never read, the disk serves, and
    ``forget_other_allocations`` frees it."""

    def __init__(self, root: Path, node: str, allocation: str | None) -> None:
        self.root = root
        self.node = node
        self.directory = root / node / f"alloc-{_safe(allocation or 'unknown')}"

    def forget_other_allocations(self) -> list[str]:
        """Remove what other allocations of this run left on this node; the names removed."""
        gone = []
        with contextlib.suppress(OSError):
            for d in (self.root / self.node).iterdir():
                if d != self.directory and d.name.startswith("alloc-"):
                    shutil.rmtree(d, ignore_errors=True)
                    gone.append(d.name)
        return gone

    def step_dir(self, step: int, world: int) -> Path:
        return self.directory / f"step-{step:08d}-w{world}"

    def begin(self, step: int, world: int, rank: int, nbytes: int) -> PendingShard:
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
                    meta_bytes = meta_path.stat().st_size
                    nbytes = int(json.loads(meta_path.read_bytes())["nbytes"])
                    if (d / f"rank-{rank:05d}.bin").stat().st_size != nbytes:
                        continue
                except (OSError, ValueError, KeyError, TypeError):
                    continue
                out.setdefault(step, {}).setdefault(world, {})[rank] = (nbytes, meta_bytes)
        return out

    def read(self, step: int, world: int, rank: int) -> tuple[bytes, bytes]:
        """(description, payload) of a held shard."""
        d = self.step_dir(step, world)
        return (d / f"rank-{rank:05d}.json").read_bytes(), (d / f"rank-{rank:05d}.bin").read_bytes()

    def prune(self, ranks: list[int], keep_last: int) -> None:
        """Remove ``ranks``' shards beyond the newest ``keep_last`` steps (each rank prunes what it
        wrote, so no two ranks remove the same file), and the step directories left empty."""
        dirs = sorted(self._step_dirs(), reverse=True)
        for _, _, d in dirs[keep_last:]:
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

    def remove(self) -> None:
        """This allocation's directory on the node (and the node's, when it is left empty)."""
        shutil.rmtree(self.directory, ignore_errors=True)
        with contextlib.suppress(OSError):
            self.directory.parent.rmdir()

    def _step_dirs(self) -> list[tuple[int, int, Path]]:
        try:
            entries = list(self.directory.iterdir())
        except OSError:
            return []
        found = []
        for d in entries:
            m = _STEP_DIR.match(d.name)
            if m is not None and d.is_dir():
                found.append((int(m.group(1)), int(m.group(2)), d))
        return found


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)


def describe_json(meta: Mapping[str, object]) -> bytes:
    return json.dumps(meta, sort_keys=True, separators=(",", ":")).encode()
