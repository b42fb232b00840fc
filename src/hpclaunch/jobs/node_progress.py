"""One node's ranks as its agent sees them, and the one file per node the decider reads.

The ranks write their heartbeats on their node (``rundir.progress_files.local_progress_dir``); the agent
reads them there (no shared-filesystem operation), judges each rank's stall on its own clock with
the watchdog's windows, and keeps the node's aggregate, ``RUN/attempts/<attempt>/node<n>.progress.json``
(every rank's record with its stall and window, and the ranks' recent step-time summaries), in
one file it holds open and rewrites in place: a data write, no metadata operation, as the
heartbeat is. A node whose rank stalled past its window says so by creating
``RUN/attempts/<attempt>/stalled/node<n>`` (removed once the rank moves again).

The decider reads these files, not the ranks': every node's at once only when a node says it has
a stalled rank (one listing of ``stalled/`` per look), and in steady training a few per second in
turn (``LEAD_READS_PER_S``) for the straggler tracker. Its cost on the metadata server no longer
grows with the number of ranks: at 512 nodes of 8 ranks it read 4,096 files per second before.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from ..fsutil import create_exclusive, poll_json
from ..rundir import RunPaths
from ..rundir.progress_files import local_progress_dir, node_progress_file, progress_file
from ..rundir.shm import private_dirs

SUMMARIES_KEPT = 16  # per rank: enough for the decider's turn over 512 nodes at a step a second
LEAD_READS_PER_S = 1.0  # other nodes' files the decider reads per second in steady training


def stalled_dir(paths: RunPaths, attempt: str) -> Path:
    return paths.attempt_dir(attempt) / "stalled"


class NodeFiles:
    """This node's side: its ranks' local heartbeats read, its aggregate and stall marker written."""

    def __init__(
        self,
        paths: RunPaths,
        attempt: str,
        *,
        host: str,
        node_rank: int,
        ranks: Iterable[int],
        local_dir: Path | None,
        expected: int = 0,
    ) -> None:
        self.paths = paths
        self.attempt = attempt
        self.host = host
        self.node_rank = node_rank
        self.ranks = tuple(ranks)  # (without a local folder: the shared files of these ranks)
        self.local_dir = local_dir
        self.expected = expected  # ranks this node runs (their numbers are the rendezvous' to give)
        self.path = node_progress_file(paths, attempt, node_rank)
        self._fd: int | None = None
        self._marked = False
        self._summaries: dict[int, dict[int, dict[str, Any]]] = {}  # rank -> step -> summary
        self._fed: set[tuple[int, int]] = set()  # (rank, step) handed to the tracker already

    def records(self) -> dict[int, dict[str, Any]]:
        """This node's ranks' heartbeats now (a rank whose file is missing or half written is left
        out: the caller keeps its last one). Node-local where the agent set the folder; else (no
        agent: a test, a hand-run trainer) the shared per-rank files."""
        found: dict[int, dict[str, Any]] = {}
        paths: list[Path] = []
        if self.local_dir is not None:
            with contextlib.suppress(OSError):
                paths = sorted(self.local_dir.glob("rank*.progress.json"))
        else:
            paths = [progress_file(self.paths, self.attempt, rank) for rank in self.ranks]
        for path in paths:
            data = poll_json(path, attempts=1)
            if isinstance(data, dict) and isinstance(data.get("rank"), int):
                rank = int(data["rank"])
                found[rank] = data
                for line in data.get("summaries") or []:
                    if isinstance(line, dict) and isinstance(line.get("step"), int):
                        kept = self._summaries.setdefault(rank, {})
                        kept[int(line["step"])] = line
                        for old in sorted(kept)[:-SUMMARIES_KEPT]:
                            del kept[old]
        return found

    def new_summaries(self) -> list[dict[str, Any]]:
        """This node's step-time summaries not handed out yet (for the decider's tracker)."""
        return _unseen(self._summaries, self._fed)

    def publish(
        self, records: Mapping[int, Mapping[str, Any]], judged: Mapping[int, tuple[float, float]]
    ) -> None:
        """Rewrite this node's aggregate in place: every rank's record with its (stall, window) as
        this agent judged them; never raises (the next poll writes again)."""
        ranks = [
            {**records[r], "stalled_s": round(judged[r][0], 3), "window_s": judged[r][1]} for r in records
        ]
        summaries = [line for kept in self._summaries.values() for line in kept.values()]
        body = json.dumps(
            {"node": self.host, "node_rank": self.node_rank, "ranks": ranks, "summaries": summaries}
        )
        data = body.encode()
        try:
            if self._fd is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o644)
            os.pwrite(self._fd, data, 0)
            os.ftruncate(self._fd, len(data))
            os.fdatasync(self._fd)
        except OSError:
            self.close()  # (a stale handle after a server restart: the next write opens it again)

    def mark(self, stalled: bool) -> None:
        """Say (or stop saying) that a rank of this node stalled past its window."""
        if stalled == self._marked:
            return
        marker = stalled_dir(self.paths, self.attempt) / f"node{self.node_rank}"
        with contextlib.suppress(OSError):
            if stalled:
                create_exclusive(marker, self.host)
            else:
                marker.unlink(missing_ok=True)
            self._marked = stalled

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)


class OtherNodes:
    """The decider's side: the other nodes' aggregates, read all at once on a stall, else in turn."""

    def __init__(self, paths: RunPaths, attempt: str, node_ranks: Iterable[int]) -> None:
        self.paths = paths
        self.attempt = attempt
        self.nodes = tuple(node_ranks)
        self.latest: dict[int, dict[str, Any]] = {}  # node rank -> its aggregate as last read
        self._turn = 0
        self._summaries: dict[int, dict[int, dict[str, Any]]] = {}
        self._fed: set[tuple[int, int]] = set()

    def stalled(self) -> bool:
        """Whether any node says a rank of its stalled past its window (one listing)."""
        try:
            return any(not n.startswith(".") for n in os.listdir(stalled_dir(self.paths, self.attempt)))
        except OSError:
            return False

    def read_all(self) -> None:
        for node in self.nodes:
            self._read(node)

    def read_some(self, count: int) -> None:
        """The next ``count`` nodes' aggregates, in turn."""
        for _ in range(min(count, len(self.nodes))):
            self._read(self.nodes[self._turn % len(self.nodes)])
            self._turn += 1

    def _read(self, node: int) -> None:
        data = poll_json(node_progress_file(self.paths, self.attempt, node), attempts=1)
        if not isinstance(data, dict):
            return  # (missing, or caught half rewritten: the last one read stands)
        self.latest[node] = data
        for line in data.get("summaries") or []:
            if (
                isinstance(line, dict)
                and isinstance(line.get("rank"), int)
                and isinstance(line.get("step"), int)
            ):
                self._summaries.setdefault(int(line["rank"]), {})[int(line["step"])] = line

    def records(self) -> dict[int, dict[str, Any]]:
        """Every rank's entry (record, stall, window) of the nodes read so far."""
        found: dict[int, dict[str, Any]] = {}
        for data in self.latest.values():
            for entry in data.get("ranks") or []:
                if isinstance(entry, dict) and isinstance(entry.get("rank"), int):
                    found[int(entry["rank"])] = entry
        return found

    def new_summaries(self) -> list[dict[str, Any]]:
        return _unseen(self._summaries, self._fed)


def _unseen(
    kept: Mapping[int, Mapping[int, dict[str, Any]]], fed: set[tuple[int, int]]
) -> list[dict[str, Any]]:
    out = []
    for rank, by_step in kept.items():
        for step, line in by_step.items():
            if (rank, step) not in fed:
                fed.add((rank, step))
                out.append(line)
    return out


def prepare_local_dir(node_dir: Path, root: Path, host: str, attempt: str) -> Path:
    """This node's folder for ``attempt``'s rank heartbeats, in this user's node directory
    (``rundir.node_dir``, private already), each folder below it made 0700 and checked."""
    path = local_progress_dir(node_dir, root, host, attempt)
    return private_dirs(path, node_dir.parent, root=node_dir)


def remove_local_dirs(node_dir: Path, root: Path, host: str, allocation: str) -> None:
    """This node's rank heartbeats of ``allocation``'s attempts, when its agent leaves (they are in
    the node files). Only its own: the agent of the job that continues the run may already be
    writing beside them on this node."""
    folder = local_progress_dir(node_dir, root, host, allocation).parent
    with contextlib.suppress(OSError):
        for attempt in folder.iterdir():
            if attempt.name == allocation or attempt.name.startswith(f"{allocation}."):
                shutil.rmtree(attempt, ignore_errors=True)
