"""How the node agents of one allocation agree between attempts, through the run directory.

Every agent stays for the whole allocation: a training node's agent runs its ranks, a hot spare's
agent waits (its rank host warm). After each attempt one decision says what happens next, and for
an in-place continuation which nodes train (the roster: a spare takes a failed node's place, at the
same position, so the world size and the ranks' order stay those of the run).

The files, and what each costs on a shared filesystem (N nodes):

- ``RUN/agents/<job>/<host>``: each agent touches its own file every ``BEAT_S`` (one metadata write
  per node per beat). Read only when a decision needs to know who is alive: O(N) once per attempt.
- ``attempts/<attempt>/end``: created by the first agent whose attempt ended (its ranks failed or
  finished): every other agent stops its ranks when it sees it. One ``stat`` per agent per poll.
- ``attempts/<attempt>/node<r>.done.json``: each agent's report (its rank host's answer). Read by the
  decider once, at decision time.
- ``attempts/<attempt>/decision.json``: the one decision. Created with ``link()`` of a written file,
  so two agents can never both decide (atomic on NFS too); the others ``stat`` it per poll.

Who decides: node 0's agent; when its heartbeat has stopped (its node died), the first agent, in
allocation order, whose heartbeat is alive. The exclusive create makes any race harmless.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..fsutil import atomic_write_json, create_exclusive
from ..rundir import RunPaths

BEAT_S = float(os.environ.get("HPCLAUNCH_AGENT_BEAT_S") or 1.0)
DEAD_AFTER_S = float(os.environ.get("HPCLAUNCH_AGENT_DEAD_S") or 8.0)  # silent this long: gone
REPORT_GRACE_S = 60.0  # how long the decider waits for a live node's report before it decides


@dataclass(frozen=True)
class Roster:
    """The training nodes of one attempt, in rank order, and the spares waiting beside them."""

    training: tuple[str, ...]
    spares: tuple[str, ...] = ()

    def replaced(self, pairs: Iterable[tuple[str, str]]) -> Roster:
        """Each failed node's place goes to its spare; the failed node leaves the allocation's use."""
        training, spares = list(self.training), list(self.spares)
        for bad, spare in pairs:
            if bad in training:
                training[training.index(bad)] = spare
            if spare in spares:
                spares.remove(spare)
        return Roster(tuple(training), tuple(spares))

    def to_json(self) -> dict[str, Any]:
        return {"training": list(self.training), "spares": list(self.spares)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Roster:
        return cls(tuple(data.get("training") or ()), tuple(data.get("spares") or ()))

    @classmethod
    def initial(cls, hosts: tuple[str, ...], training: int, failed: Iterable[str] = ()) -> Roster:
        """The allocation's first ``training`` hosts train, the rest wait as spares; a host that
        failed its node check is neither (a healthy spare takes its place)."""
        bad = set(failed)
        roster = cls(hosts[:training], tuple(h for h in hosts[training:] if h not in bad))
        return roster.replaced(zip((h for h in roster.training if h in bad), roster.spares, strict=False))


class Allocation:
    """One agent's view of its allocation's coordination files (see the module docstring)."""

    def __init__(self, paths: RunPaths, job: str, host: str, hosts: tuple[str, ...]):
        self.paths = paths
        self.host = host
        self.hosts = hosts
        self.beats = paths.root / "agents" / job.replace("/", "_")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- heartbeats ------------------------------------------------------------------------------

    def start_beating(self) -> None:
        self.beats.mkdir(parents=True, exist_ok=True)
        self.beat()
        self._thread = threading.Thread(target=self._beat_loop, name="hpclaunch-agent-beat", daemon=True)
        self._thread.start()

    def stop_beating(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def beat(self) -> None:
        path = self.beats / self.host
        try:
            os.utime(path)
        except FileNotFoundError:
            path.touch()

    def _beat_loop(self) -> None:
        while not self._stop.wait(BEAT_S):
            with contextlib.suppress(OSError):  # a filesystem hiccup: the next beat tries again
                self.beat()

    def alive(self, host: str, now: float | None = None) -> bool:
        try:
            age = (time.time() if now is None else now) - (self.beats / host).stat().st_mtime
        except FileNotFoundError:
            return False
        return age < DEAD_AFTER_S

    def decider(self, now: float | None = None) -> str | None:
        """Node 0's host while its agent beats; else the first live agent in allocation order."""
        return next((h for h in self.hosts if self.alive(h, now)), None)

    # ---- one attempt ---------------------------------------------------------------------------

    def _dir(self, attempt: str) -> Path:
        return self.paths.attempt_dir(attempt)

    def signal_end(self, attempt: str, why: str) -> None:
        """This attempt is over (for whoever sees it first): every agent stops its ranks."""
        path = self._dir(attempt) / "end"
        if not path.exists():
            with contextlib.suppress(OSError):
                create_exclusive(path, json.dumps({"by": self.host, "why": why, "ts": time.time()}))

    def ended(self, attempt: str) -> bool:
        return (self._dir(attempt) / "end").exists()

    def report(self, attempt: str, node_rank: int, result: dict[str, Any]) -> None:
        atomic_write_json(self._dir(attempt) / f"node{node_rank}.done.json", {"host": self.host, **result})

    def reports(self, attempt: str, node_ranks: Iterable[int]) -> dict[int, dict[str, Any]]:
        found = {}
        for rank in node_ranks:
            with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
                found[rank] = json.loads((self._dir(attempt) / f"node{rank}.done.json").read_text())
        return found

    def publish(self, attempt: str, record: dict[str, Any]) -> bool:
        """The decision for ``attempt``; False when another agent decided first (theirs stands)."""
        return create_exclusive(self._dir(attempt) / "decision.json", json.dumps(record, indent=1) + "\n")

    def decision(self, attempt: str) -> dict[str, Any] | None:
        try:
            data = json.loads((self._dir(attempt) / "decision.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None
        return data if isinstance(data, dict) else None
