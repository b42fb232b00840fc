"""How the node agents of one allocation agree between attempts, through the run directory.

Every agent stays for the whole allocation: a training node's agent runs its ranks, a hot spare's
agent waits (its rank host warm). After each attempt one decision says what happens next, and for
an in-place continuation which nodes train (the roster: a spare takes a failed node's place, at the
same position, so the world size and the ranks' order stay those of the run).

The files, and what each costs on a shared filesystem (N nodes; counted by
``bench/recovery.py --scenario agree``, which wraps every filesystem call: a call that names a path
is one metadata operation, a write or flush on an open descriptor a data operation):

- ``RUN/agents/<job>/<host>``: each agent rewrites its own file every ``BEAT_S`` with a counter (its
  pid and the beat's number, in place, fixed width: no rename, no truncation). The file stays open:
  a beat is one data write and its flush, no metadata operation. Read only when someone needs to
  know who is alive. Liveness is by
  observation: an observer notes when it last saw the counter change, on its own monotonic clock,
  and calls a host gone only after ``DEAD_AFTER_S`` without a change seen by reads that succeeded
  (a heartbeat the observer cannot read, ESTALE or EIO on its side, ages nothing; an open link to
  the host is evidence of its life meanwhile). Nothing compares a remote
  file's mtime with the local clock: NFS caches attributes for 3-60 s and clocks skew, so an mtime
  makes a live node look dead (or a dead one alive). Reading the content is safe under NFS's
  close-to-open consistency: every read opens the file.
- ``attempts/<attempt>/end``: created by the first agent whose attempt ended (its ranks failed or
  finished): every other agent stops its ranks when it sees it. One ``stat`` per agent per
  ``LOOK_S`` (a peer's failure reaches the ranks through their collectives first; this is the
  backstop).
- ``attempts/<attempt>/node<r>.done.json``: each agent's report (its rank host's answer). Read by the
  decider until found (each once), at decision time.
- ``attempts/<attempt>/decision.json``: the one decision. Created with ``link()`` of a written file,
  so two agents can never both decide (atomic on NFS too); the others read it per ``POLL_S`` while
  they wait for it (seconds, after an attempt).

While the ranks train, an agent that does not decide makes three metadata operations per
``LOOK_S`` (4 s): the ``end`` file, the decider's heartbeat, the watchdog's verdict file
(``watchdog.Watchdog.follow_s``): 0.75 per second, the same at any N; its node's progress file is
rewritten in place (a data write). The decider leads the watchdog: a listing of the stalled nodes
per look, rank 0's outcome per look, and one other node's progress file per second in turn
(``node_progress.LEAD_READS_PER_S``): under 2 per second at any N (every node's file at once only
when a node says a rank stalled).

Who decides (a role, not a host): the first live agent among the nodes the run is using, in
roster order (the training nodes, then the spares): node 0's at the start; after a replacement or a
death, the next one. A node the roster left (replaced by a spare) never decides. The decider also
leads the watchdog and cuts overrunning stop saves off (``jobs.agent``). The exclusive create makes
a race between two agents that both think they decide harmless.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict, cast

from ..fsutil import atomic_write_json, create_exclusive, poll_exists, poll_json, retry_patiently
from ..rundir import RunPaths
from ..rundir.attempt_records import AttemptEnd, RosterJSON
from .links import Links, Listener

BEAT_S = float(os.environ.get("HPCLAUNCH_AGENT_BEAT_S") or 1.0)
DEAD_AFTER_S = float(os.environ.get("HPCLAUNCH_AGENT_DEAD_S") or 8.0)  # unchanged this long: gone
# A host that has not beaten yet is starting, not gone, for this long after an observer first looked
# for it: launchers start the agents of one allocation seconds apart (MPICH's hydra, a loaded node),
# and at 512 nodes minutes apart (a cold Python on a shared filesystem). As long as the start
# barrier's gather waits for a node's verdict (``node_checks.GATHER_TIMEOUT_S`` is this): shorter,
# and a node still starting was called gone and replaced before the gather gave up on it.
START_GRACE_S = float(os.environ.get("HPCLAUNCH_AGENT_START_S") or 180.0)
_NEVER = "\0never"  # the token of a host not seen beating yet
BEAT_WIDTH = 32  # "<pid> <count>" padded: rewritten in place, never shorter than before
REPORT_GRACE_S = 60.0  # how long the decider waits for a live node's report before it decides
POLL_S = 0.2
# How often an agent whose ranks train looks at the allocation's files (the ``end`` file, the
# decider's heartbeat, a hang verdict): each look is one metadata operation on the shared
# filesystem per node, so not every poll. A peer's failure reaches this node's ranks through their
# own collectives first (a broken connection fails them); these looks are the backstop.
LOOK_S = float(os.environ.get("HPCLAUNCH_AGENT_LOOK_S") or 4.0)


def node_ranks(hosts: tuple[str, ...], of: tuple[str, ...]) -> dict[int, str]:
    """Node rank (the host's place in the allocation's ``hosts``) -> host, for the hosts ``of``."""
    ranks = {h: r for r, h in enumerate(hosts)}
    return {ranks[h]: h for h in of if h in ranks}


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

    def to_json(self) -> RosterJSON:
        return {"training": list(self.training), "spares": list(self.spares)}

    @classmethod
    def from_json(cls, data: RosterJSON) -> Roster:
        return cls(tuple(data.get("training") or ()), tuple(data.get("spares") or ()))

    @property
    def nodes(self) -> tuple[str, ...]:
        """Every node the run is using, in order: the training nodes, then the spares."""
        return (*self.training, *self.spares)

    def without(self, failed: Iterable[str]) -> Roster:
        """Each failed training node's place goes to a healthy spare, in order; failed spares leave.
        A failed training node with no spare left stays (the caller sees it is not covered)."""
        bad = set(failed)
        healthy = tuple(h for h in self.spares if h not in bad)
        pairs = zip((h for h in self.training if h in bad), healthy, strict=False)
        return Roster(self.training, healthy).replaced(pairs)


class _DecisionRequired(TypedDict):
    attempt: str
    action: str  # decide.Action's value
    cause: str | None
    in_place: bool
    by: str  # the deciding agent's host


class DecisionRecord(_DecisionRequired, total=False):
    """``decision.json``: the one decision on an attempt, as every agent of the allocation reads it."""

    next: str  # in place: the next attempt
    roster: RosterJSON  # in place: the roster it runs on
    epoch: int  # the run lock's epoch its decider held (``jobs.fenced``)
    nonce: str  # this very publication (a retried link() that says EEXIST is still ours)
    reason: str  # the decision in words, and what carrying it out needs (another decider may)
    exclude: list[str]
    counts_as: str
    replace: list[list[str]]  # in place: [failed node, the spare taking its place]
    suspect: str  # the node a crash was pinned on
    step: int  # the step the attempt reached (its record's `step`, whoever makes it)
    exit_code: int  # never published: the decider's own exit code, once it carried the decision out


class Allocation:
    """One agent's view of its allocation's coordination files (see the module docstring)."""

    def __init__(
        self,
        paths: RunPaths,
        job: str,
        host: str,
        hosts: tuple[str, ...],
        *,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.paths = paths
        self.host = host
        self.hosts = hosts
        self.beats = paths.root / "agents" / job.replace("/", "_")
        self.clock = clock
        self._count = 0
        self._fd: int | None = None  # this agent's heartbeat file, kept open between beats
        self._seen: dict[str, tuple[str, float]] = {}  # host -> (its last token, when it changed here)
        self._read_at: dict[str, float] = {}  # host -> when this observer last looked at its heartbeat
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.links: Links | None = None  # the first evidence of a death (``links``), once listening
        self._listener: Listener | None = None

    # ---- the first evidence: connections the kernel closes when an agent dies (``links``) ----------

    def listen(self, address: str) -> None:
        """Accept the other agents' connections at ``address`` (this node's), and watch theirs."""
        folder = self.beats / "links"
        folder.mkdir(parents=True, exist_ok=True)
        self._listener = Listener(folder, self.host, address)
        self.links = Links(folder, self.host)

    def watch(self, hosts: Iterable[str]) -> None:
        """Hold a connection to each of ``hosts`` (their death is then known at once)."""
        if self.links is not None:
            self.links.watch(hosts)

    def known_dead(self, host: str) -> bool:
        """``host``'s agent is dead by the first evidence (its connection ended, nothing listens)."""
        return self.links is not None and self.links.ended(host)

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
        self._close()
        for end in (self._listener, self.links):
            if end is not None:
                end.close()

    def beat(self) -> None:
        """One beat: the counter changes (written in place at a fixed width, so a reader never sees
        an empty or half-written file where the old content was). The file stays open between
        beats: a beat is a data write and its flush to the server (``fdatasync``: readers on other
        nodes see it at their next open), no lookup or open on the metadata server."""
        self._count += 1
        line = f"{os.getpid()} {self._count}".ljust(BEAT_WIDTH - 1) + "\n"
        if self._fd is None:
            self._fd = os.open(self.beats / self.host, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            os.pwrite(self._fd, line.encode(), 0)
            os.fdatasync(self._fd)
        except OSError:
            self._close()  # (a stale handle after a server restart: the next beat opens it again)
            raise

    def _close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    def _beat_loop(self) -> None:
        while not self._stop.wait(BEAT_S):
            with contextlib.suppress(OSError):  # a filesystem hiccup: the next beat tries again
                self.beat()

    def _token(self, host: str) -> str | None:
        """What ``host``'s heartbeat says now: None when it has never beaten (no file)."""
        try:
            return (self.beats / host).read_text().strip()
        except FileNotFoundError:
            return None

    def alive(self, host: str, now: float | None = None) -> bool:
        """``host``'s agent beats: its counter changed within ``DEAD_AFTER_S`` of this observer's own
        monotonic clock. The first look at a host that has beaten counts as a change (it is given
        the full ``DEAD_AFTER_S`` before it can be called gone); a host with no heartbeat yet is
        starting for ``START_GRACE_S`` from this observer's first look, then gone."""
        now = self.clock() if now is None else now
        if host == self.host and not self._stop.is_set():
            return True  # this agent is alive by definition while it beats
        if self.links is not None and self.links.dead(host):
            return False  # the first evidence: its connection ended and nothing listens there
        try:
            token = self._token(host)
        except OSError:
            return self._unread(host, now)
        seen = self._seen.get(host)
        self._read_at[host] = now
        if token is None:
            if seen is None:
                self._seen[host] = (_NEVER, now)
                return True
            return seen[0] == _NEVER and now - seen[1] < START_GRACE_S
        if seen is None or (token and token != seen[0]):
            self._seen[host] = (token or (seen[0] if seen else ""), now)
            return True
        return now - seen[1] < (START_GRACE_S if seen[0] == _NEVER else DEAD_AFTER_S)

    def _unread(self, host: str, now: float) -> bool:
        """``host``'s heartbeat cannot be read now (ESTALE, EIO: the observer's filesystem, not the
        host, is what fails): no observation, so nothing ages. An open link to it is evidence of
        life (its kernel would have closed it with its agent); without one, the last observation is
        kept as it stood at the last read, and the window goes on only once reads succeed again."""
        seen = self._seen.get(host)
        last = self._read_at.get(host, now)
        self._read_at[host] = now
        if self.links is not None and self.links.linked(host):
            self._seen[host] = (seen[0] if seen else "", now)
            return True
        if seen is None:
            self._seen[host] = (_NEVER, now)
            return True
        self._seen[host] = (seen[0], seen[1] + (now - last))  # (the unreadable time is not counted)
        return now - self._seen[host][1] < (START_GRACE_S if seen[0] == _NEVER else DEAD_AFTER_S)

    def decider(self, roster: Roster | None = None, now: float | None = None) -> str | None:
        """Who decides: the first live agent in ``roster`` order (training nodes, then spares); with
        none alive there, the first live agent of the allocation."""
        order = [*roster.training, *roster.spares] if roster is not None else []
        order += [h for h in self.hosts if h not in order]
        return next((h for h in order if self.alive(h, now)), None)

    # ---- one attempt ---------------------------------------------------------------------------

    def _dir(self, attempt: str) -> Path:
        return self.paths.attempt_dir(attempt)

    def signal_end(self, attempt: str, why: str) -> None:
        """This attempt is over (for whoever sees it first): every agent stops its ranks."""
        path = self._dir(attempt) / "end"
        if not poll_exists(path):
            with contextlib.suppress(OSError):
                create_exclusive(path, json.dumps({"by": self.host, "why": why, "ts": time.time()}))

    def ended(self, attempt: str) -> bool:
        return poll_exists(self._dir(attempt) / "end")

    def report(self, attempt: str, node_rank: int, result: AttemptEnd) -> None:
        path = self._dir(attempt) / f"node{node_rank}.done.json"
        retry_patiently(lambda: atomic_write_json(path, {"host": self.host, **result}))

    def reports(self, attempt: str, node_ranks: Iterable[int]) -> dict[int, AttemptEnd]:
        """The reports found now (one that cannot be read for now is looked for again next time)."""
        found: dict[int, AttemptEnd] = {}
        for rank in node_ranks:
            data = poll_json(self._dir(attempt) / f"node{rank}.done.json")
            if isinstance(data, dict):
                found[rank] = cast(AttemptEnd, data)
        return found

    def publish(self, attempt: str, record: DecisionRecord) -> bool:
        """The decision for ``attempt``; False when another agent decided first (theirs stands)."""
        path = self._dir(attempt) / "decision.json"
        return retry_patiently(lambda: create_exclusive(path, json.dumps(record, indent=1) + "\n"))

    def decision_file(self, attempt: str) -> Path:
        return self._dir(attempt) / "decision.json"

    def decision(self, attempt: str) -> DecisionRecord | None:
        data = poll_json(self.decision_file(attempt))
        return cast(DecisionRecord, data) if isinstance(data, dict) else None  # as ``publish`` wrote it


def await_reports(
    alloc: Allocation,
    attempt: str,
    expect: Mapping[int, str],
    *,
    grace_s: float = REPORT_GRACE_S,
    poll: Callable[[], None] = lambda: None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The decider waits for the reports of the nodes in ``expect`` (node rank -> host) and
    returns (dead, stuck) among the silent ones.

    Dead: silent, and its heartbeat stopped changing (by observation, ``Allocation.alive``). Stuck:
    silent ``grace_s`` after the attempt was seen over somewhere (a report, or the ``end`` file),
    yet beating: alive but slow (ranks in D-state, a rank host still in rendezvous). A beating node
    is never dead for being slow: it is a hang, with its own cause and budget. While no node has
    ended, it waits as long as the attempt runs (``poll`` runs the watchdog meanwhile)."""
    over_since: float | None = None
    dead: list[str] = []
    reports: dict[int, AttemptEnd] = {}  # a report is written once: read until found, not after
    next_look = clock()
    while True:
        reports.update(alloc.reports(attempt, [r for r in expect if r not in reports]))
        silent = [h for r, h in expect.items() if r not in reports]
        if not silent:
            return (), ()
        now = clock()
        look = now >= next_look
        if over_since is None and (reports or (look and alloc.ended(attempt))):
            over_since = now
        if look:  # one read per silent node per beat, not per poll
            next_look = now + BEAT_S
            dead = [h for h in silent if not alloc.alive(h, now)]
        else:  # the first evidence (a connection that ended) costs no read: every poll
            dead = [h for h in silent if h in dead or alloc.known_dead(h)]
        if dead and len(dead) == len(silent):
            return tuple(dead), ()
        if over_since is not None and now - over_since >= grace_s:
            return tuple(dead), tuple(h for h in silent if h not in dead)
        poll()
        sleep(POLL_S)
