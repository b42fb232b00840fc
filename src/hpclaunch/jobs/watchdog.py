"""The node agent's watchdog: a window per phase over every rank's progress, and what a hang leaves.

While the ranks run, every agent reads its own node's ranks' heartbeats on the node and keeps one
file per node (``node_progress``); the deciding agent (the ``lead``: node 0's at first; the role
moves with the decider when node 0 leaves the roster or dies, and it leads whether its node trains
or not) judges every rank: its own node's every ``watchdog.poll_s``, the others' from their node
files, all of them when a node says a rank of its stalled past its window (issue 36: it read every
rank's files every poll before, 4,098 metadata operations per second at 512 nodes). A rank
*advances* when its step or phase changes. Windows:

- launch (the rank host's start of the attempt to a rank's first report: imports, rendezvous):
  ``launch_s``;
- start-up (the ``startup`` phase: smoke test, data check, model): ``startup_s``; the first step
  of an attempt (allocation, warm-up, compilation) gets it too;
- checkpoint ``load`` and ``save``, ``eval`` and the final teardown (``done``): ``checkpoint_s``,
  widened for ``load`` and ``save`` as the checkpoint grows: twice its size (the newest manifest's)
  at a slow filesystem's rate, and for ``save`` three times the slowest save this run measured; a
  terabyte checkpoint is not a hang for taking an hour to read;
- training steps (``data``, ``compute``, ``collective``): ``max(step_min_s, step_factor x the
  slowest recent step)``.

The culprit. In a hung collective every rank stops advancing, so stopping alone names no one. A rank
*waits* when its phase is ``collective`` or its main thread is inside a ``torch.distributed`` call
(sampled by its own heartbeat thread). Of the ranks that do not wait, the ones furthest behind
(lowest step, then earliest phase of the step) are the ones the others wait for: the culprits, and
their windows decide. When no rank stands apart (every rank waits, or all are at the same place)
the verdict says "no single culprit known" and any rank past its window decides. The evidence names
a node when every culprit rank runs on it (or, with no culprit, when the whole run is on one node).

On a verdict the lead writes ``RUN/attempts/<attempt>/hang.json``; every node's agent (the lead too)
then dumps its ranks' Python stacks (``STACK_SIGNAL``, faulthandler in the worker) into the
attempt's log directory, asks NCCL ranks for their flight record (a write to torch's dump pipe),
says it is done, waits for the other nodes (a killed rank would break its peers' collectives before
their stacks are taken) and kills its workers. The lead records the ``hang`` event; the agent then
ends the attempt with cause ``hang`` (``decide``). Only the lead judges, so the verdict is the same
on every node.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..config import WatchdogConfig
from ..fsutil import atomic_write_json
from ..rundir import HANG, STRAGGLER, AttemptOutcome, Ledger, RunPaths, read_outcome
from ..rundir.cause import Cause
from ..rundir.events import CheckpointSaved, Event, of_kind
from ..rundir.progress_files import (
    NCCL_TRACE_STEM,
    PHASE_ORDER,
    ProgressRecord,
    hang_file,
    nccl_dump_dir,
    read_progress,
)
from ..schedulers.protocol import NodeContext
from .allocation import LOOK_S
from .hang_evidence import dump_stacks, file_size, stop_workers, trigger_flight_recorder
from .node_progress import LEAD_READS_PER_S, NodeFiles, OtherNodes
from .straggler_tracker import StragglerTracker

LONG_PHASES = ("load", "save", "eval", "done")
LEDGER_STATES = 64  # ranks whose state the hang event lists (all of them are in hang.json)
# A slow shared filesystem as one rank sees it: every checkpoint byte read (a DDP rank reads them
# all) or hashed at this rate still fits the load window.
SLOW_IO_BPS = 50e6
SAVE_WINDOW_FACTOR = 3.0  # a save may take this many times the slowest one measured before it is a hang
# While a stall stands, the lead reads every node's aggregate at most this many files per second.
JUDGE_READS_PER_S = 32.0


@dataclass(frozen=True)
class CheckpointScale:
    """What the load and save windows grow with: the checkpoint's size and the slowest save."""

    bytes: int = 0
    slowest_save_s: float = 0.0

    @classmethod
    def of_run(cls, paths: RunPaths, events: Sequence[Event]) -> CheckpointScale:
        saves = of_kind(events, CheckpointSaved)
        slowest = max((float(e.seconds or 0) for e in saves), default=0.0)
        size = max((int(e.bytes or 0) for e in saves[-4:]), default=0)
        return cls(max(size, newest_manifest_bytes(paths.checkpoints)), slowest)


def newest_manifest_bytes(directory: Path) -> int:
    """``total_bytes`` of the newest published checkpoint's manifest (0: none, or unreadable)."""
    try:
        steps = sorted(p for p in directory.glob("step_*") if p.is_dir() and "." not in p.name)
        data = json.loads((steps[-1] / "manifest.json").read_text()) if steps else {}
        return int(data.get("total_bytes") or 0)
    except (OSError, ValueError, TypeError, AttributeError):
        return 0


def window_s(
    cfg: WatchdogConfig,
    phase: str,
    *,
    stepped: bool,
    recent_max_step_s: float | None,
    scale: CheckpointScale = CheckpointScale(),
) -> float:
    """How long a rank may stay in ``phase`` without advancing."""
    if phase == "startup":
        return float(cfg.startup_s)
    # What the checkpoint's size asks for (twice its bytes at a slow filesystem's rate: a load
    # hashes a share and reads, a save writes and hashes) only ever widens the configured window.
    io_s = 2 * scale.bytes / SLOW_IO_BPS
    if phase == "load":
        return max(float(cfg.checkpoint_s), io_s)
    if phase == "save":
        return max(float(cfg.checkpoint_s), io_s, SAVE_WINDOW_FACTOR * scale.slowest_save_s)
    if phase in LONG_PHASES:
        return float(cfg.checkpoint_s)
    if not stepped:  # the first step of an attempt: allocation, warm-up, compilation
        return float(max(cfg.startup_s, cfg.step_min_s))
    return max(float(cfg.step_min_s), cfg.step_factor * (recent_max_step_s or 0.0))


@dataclass(frozen=True)
class RankState:
    """One rank as the watchdog sees it at one poll."""

    rank: int
    node: str | None  # None: the rank never reported (still launching, or never started)
    step: int
    phase: str  # a progress phase, or "launch" for a rank that never reported
    waiting: str | None  # the torch.distributed call its main thread is in
    stalled_s: float  # time without advancing
    window_s: float

    @property
    def position(self) -> tuple[int, int]:
        return (self.step, PHASE_ORDER.get(self.phase, 0)) if self.node is not None else (-1, -1)

    @property
    def is_waiting(self) -> bool:
        return self.node is not None and (self.phase == "collective" or self.waiting is not None)

    def where(self) -> str:
        if self.node is None:
            return "launch (never reported)"
        at = f" at step {self.step}" if self.phase not in ("startup", "load") else ""
        inside = f" (in {self.waiting})" if self.waiting else ""
        return f"{self.phase}{at}{inside}"


@dataclass(frozen=True)
class Verdict:
    """A hang, as node 0 found it; every node acts on the same one."""

    attempt: str
    phase: str
    step: int
    culprit: str  # "rank 1 on n1" | "ranks 2, 3 on n2" | "no single culprit known"
    ranks: tuple[int, ...]  # the culprit ranks (empty: none known)
    culprit_node: str | None  # the one node the evidence names, if it names one
    reason: str  # one line, the user's words
    window_s: float
    stalled_s: float
    stalled_since: float
    detected_at: float
    states: tuple[dict[str, Any], ...]  # every rank: node, step, phase, waiting, stalled_s, window_s
    source: str = "watchdog"  # or "distributed smoke test": rank 0 named ranks missing from its barrier

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def ledger_fields(self) -> dict[str, Any]:
        """The ``hang`` event's fields: one ledger line, so the culprits' states and a sample of the
        others (``hang.json`` keeps every rank); the ledger adds the attempt itself."""
        fields = {k: v for k, v in self.to_json().items() if k != "attempt"}
        if len(self.states) > LEDGER_STATES:
            keep = [st for st in self.states if st["rank"] in self.ranks or st["rank"] < LEDGER_STATES // 2]
            fields["states"] = keep[:LEDGER_STATES]
        return fields

    @classmethod
    def stuck(cls, attempt: str, nodes: Sequence[str], waited_s: float) -> Verdict:
        """Nodes whose agent beats but whose ranks did not end within ``waited_s`` of the attempt's
        end elsewhere (ranks in D-state, a rank host stuck in rendezvous): alive but stuck, a hang
        with its own budget, never a dead node."""
        node = nodes[0] if len(nodes) == 1 else None
        now = time.time()
        return cls(
            attempt=attempt,
            phase="teardown",
            step=0,
            culprit=f"node{'s' if len(nodes) > 1 else ''} {', '.join(nodes)}",
            ranks=(),
            culprit_node=node,
            reason=f"{', '.join(nodes)}: the agent beats but its ranks did not end within "
            f"{waited_s:.0f} s of the attempt's end",
            window_s=waited_s,
            stalled_s=waited_s,
            stalled_since=now - waited_s,
            detected_at=now,
            states=(),
            source="agent heartbeat",
        )

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Verdict:
        data = {**data, "ranks": tuple(data.get("ranks") or ()), "states": tuple(data.get("states") or ())}
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


def culprits(states: Sequence[RankState]) -> list[RankState]:
    """The ranks the others wait for (see the module docstring); empty when none stands apart."""
    candidates = [s for s in states if not s.is_waiting]
    if not candidates:
        return []
    behind = min(s.position for s in candidates)
    found = [s for s in candidates if s.position == behind]
    if len(found) == len(states) > 1:
        return []
    return found


def find_hang(states: Sequence[RankState], *, attempt: str, now: float) -> Verdict | None:
    """The verdict when the ranks that hold the run back have stalled past their windows."""
    suspects = culprits(states)
    over = [s for s in (suspects or states) if s.stalled_s > s.window_s]
    if not over:
        return None
    worst = max(over, key=lambda s: s.stalled_s - s.window_s)
    group = suspects or list(states)
    nodes = {s.node for s in group}
    node = next(iter(nodes)) if len(nodes) == 1 and None not in nodes else None
    culprit = _who(suspects) if suspects else "no single culprit known"
    stalled = f"no progress for {worst.stalled_s:.0f} s (window {worst.window_s:.0f} s)"
    if suspects:
        waiting = [s for s in states if s not in suspects]
        others = "; ".join(f"{_who([s])} is in {s.where()}" for s in waiting[:4])
        more = f" and {len(waiting) - 4} more" if len(waiting) > 4 else ""
        reason = f"{culprit} hung in {worst.where()}: {stalled}" + (f"; {others}{more}" if others else "")
    else:
        where = sorted({s.where() for s in states})
        places = where[0] if len(where) == 1 else ", ".join(where[:3])
        reason = f"no single culprit known: every rank stopped ({places}); {stalled}"
        if node is not None:
            reason += f"; every rank runs on {node}"
    return Verdict(
        attempt=attempt,
        phase=worst.phase,
        step=worst.step,
        culprit=culprit,
        ranks=tuple(s.rank for s in suspects),
        culprit_node=node,
        reason=reason,
        window_s=round(worst.window_s, 3),
        stalled_s=round(worst.stalled_s, 3),
        stalled_since=round(now - worst.stalled_s, 3),
        detected_at=round(now, 3),
        states=tuple({k: v for k, v in asdict(s).items()} for s in states),
    )


def _who(states: Sequence[RankState]) -> str:
    ranks = ", ".join(str(s.rank) for s in states[:8]) + (
        f" ... ({len(states)} ranks)" if len(states) > 8 else ""
    )
    label = f"rank {ranks}" if len(states) == 1 else f"ranks {ranks}"
    nodes = sorted({s.node for s in states if s.node is not None})
    return f"{label} on {', '.join(nodes)}" if nodes else label


@dataclass(frozen=True)
class Watched:
    """What one node's watchdog watches in an attempt: the run's ranks (``world_size``; ``nccl``:
    their flight recorders can be dumped), the smoke test's start-up window, and this node's own
    ranks (``local_ranks`` of them, reporting into ``local_dir``; ``alone``: the only training
    node). Without a node-local folder every rank's shared file is read on this node."""

    world_size: int
    nccl: bool = False
    smoke_timeout_s: float = 60.0
    local_dir: Path | None = None
    local_ranks: int = 0
    alone: bool = True
    # No node directory shared with this node's ranks (``rundir.node_dir``): they write their shared
    # files, read here, while the other nodes' ranks may report into theirs (read from their nodes'
    # aggregates as ever).
    shared_files: bool = False


class Watchdog:
    """One node agent's watchdog for one attempt (``check`` is called from the agent's poll loop).

    Every agent watches its own node's ranks (``own_ranks``; every rank when it is the only node),
    from their node-local heartbeats (``local_dir``; ``node_progress``) and keeps its node's
    aggregate; the lead (the decider) judges every rank: its own node's as it sees them, the other
    nodes' from their aggregates, read all at once when a node says a rank stalled past its window,
    and a few per second in turn for the straggler tracker."""

    def __init__(
        self,
        cfg: WatchdogConfig,
        paths: RunPaths,
        ctx: NodeContext,
        ledger: Ledger,
        watched: Watched,
        *,
        launched_at: float | None = None,
        lead: bool | None = None,
    ):
        self.cfg = cfg
        self.smoke_timeout_s = watched.smoke_timeout_s
        self.paths = paths
        self.ctx = ctx
        self.attempt = ctx.attempt
        self.world_size = watched.world_size
        self.nccl = watched.nccl
        self.ledger = ledger
        self.launched_at = time.time() if launched_at is None else launched_at
        self.verdict: Verdict | None = None
        self._next_poll = self.launched_at + cfg.poll_s
        self._seen: dict[int, tuple[tuple[Any, ...], float]] = {}
        self._records: dict[int, dict[str, Any]] = {}  # this node's ranks' last heartbeats
        # This node's ranks are all the ranks (the only training node; or, without a node-local
        # folder, every rank's shared file is read here): no other node's file to read.
        self.whole = watched.alone or (watched.local_dir is None and not watched.shared_files)
        self.node = NodeFiles(
            paths,
            self.attempt,
            host=ctx.hostname,
            node_rank=ctx.node_rank,
            ranks=range(watched.world_size),
            local_dir=watched.local_dir,
            expected=watched.local_ranks,
        )
        self._others: OtherNodes | None = None
        self._next_look = 0.0  # the lead's looks at the stall markers and at rank 0's outcome
        self._next_judge = 0.0
        self._someone_stalled = False
        self.tracker: StragglerTracker | None = None
        self.scale = CheckpointScale()
        self.ack_nodes: list[int] | None = None  # the nodes running ranks (None: every node)
        self._lead = False
        self.lead = ctx.is_head if lead is None else lead

    @property
    def lead(self) -> bool:
        """This node's agent decides: it judges the ranks and writes the verdict; the others read it.
        A role, not a host: it moves to another agent when the decider's node leaves or dies."""
        return self._lead

    @lead.setter
    def lead(self, value: bool) -> None:
        if value and not self._lead:
            self.scale = CheckpointScale.of_run(self.paths, self.ledger.events())
            self.tracker = StragglerTracker(
                world_size=self.world_size,
                threshold=self.cfg.straggler_threshold,
                windows=self.cfg.straggler_windows,
                attempt=self.attempt,
            )
        self._lead = value

    @property
    def follow_s(self) -> float:
        """How often a node that does not lead reads the verdict file: one metadata operation per
        look on the shared filesystem, so no more often than the agent's other looks (``LOOK_S``)."""
        return max(self.cfg.poll_s, LOOK_S)

    def check(self, worker_pids: Callable[[], list[int]], now: float | None = None) -> Verdict | None:
        """Poll when due; on a hang, gather the evidence, stop this node's workers, return the verdict."""
        if self.verdict is not None:
            return self.verdict
        now = time.time() if now is None else now
        if now < self._next_poll:
            return None
        self._next_poll = now + (self.cfg.poll_s if self.lead else self.follow_s)
        own = self.observe(now)
        if self.lead:
            verdict = self._judge(own, now)
            if verdict is None and now >= self._next_look:  # rank 0 may have named ranks missing
                self._next_look = now + LOOK_S  # from the start-up barrier (one read per look)
                outcome = read_outcome(self.paths, self.attempt)
                verdict = startup_hang(self.paths, self.attempt, outcome, window_s=self.smoke_timeout_s)
            if verdict is not None:
                with contextlib.suppress(OSError):  # the other nodes then only see their peers fail
                    atomic_write_json(hang_file(self.paths, self.attempt), verdict.to_json())
        else:
            verdict = read_verdict(self.paths, self.attempt)
        if verdict is not None:
            self.verdict = verdict
            self._respond(verdict, worker_pids())
        return verdict

    def final(self) -> None:
        """At the attempt's end: this node's ranks' last heartbeats read and published, and (the lead)
        every step-time summary not judged yet fed to the straggler tracker. A short run ended
        between two polls: its stragglers were never reported, their last summaries never read."""
        if self.verdict is not None:
            return
        self.observe(time.time())
        if self.lead:
            lines = self.node.new_summaries()
            if not self.whole:
                others = self._other_nodes()
                others.read_all()
                lines += others.new_summaries()
            self._note_stragglers(lines)

    def observe(self, now: float) -> list[RankState]:
        """This node's ranks' states now (a rank without a heartbeat is still launching); its
        aggregate rewritten, its stall marker set or cleared."""
        self._records.update(self.node.records())  # a file unreadable for one poll keeps its last record
        ranks = range(self.world_size) if self.whole else sorted(self._records)
        states = [self._state(rank, self._records.get(rank), now) for rank in ranks]
        judged = {s.rank: (s.stalled_s, s.window_s) for s in states if s.rank in self._records}
        self.node.publish(self._records, judged)
        if not self.whole:  # (a rank of this node that never reported stalls in its launch window)
            unheard = len(self._records) < self.node.expected and now - self.launched_at > self.cfg.launch_s
            self.node.mark(unheard or any(s.stalled_s > s.window_s for s in states))
        return states

    def _state(self, rank: int, raw: dict[str, Any] | None, now: float) -> RankState:
        if raw is None:
            return RankState(rank, None, 0, "launch", None, now - self.launched_at, float(self.cfg.launch_s))
        rec = ProgressRecord.from_json(raw)
        key = (rec.step, rec.phase, rec.phase_since)
        seen = self._seen.get(rank)
        if seen is None or seen[0] != key:
            seen = self._seen[rank] = (key, now)
        return RankState(rank, rec.node, rec.step, rec.phase, rec.waiting, now - seen[1], self._window(rec))

    def _window(self, rec: ProgressRecord) -> float:
        stepped = rec.last_step_s is not None
        return window_s(
            self.cfg, rec.phase, stepped=stepped, recent_max_step_s=rec.recent_max_step_s, scale=self.scale
        )

    def _judge(self, own: list[RankState], now: float) -> Verdict | None:
        """The lead's verdict: on every rank, when one of them (here, or on a node that says so)
        stalled past its window; the stragglers fed meanwhile."""
        if self.whole:
            self._note_stragglers(self.node.new_summaries())
            return find_hang(own, attempt=self.attempt, now=now)
        others = self._other_nodes()
        if now >= self._next_look:
            self._someone_stalled = others.stalled()
        others.read_some(max(1, round(self.cfg.poll_s * LEAD_READS_PER_S)))
        states = None
        stalled_here = any(s.stalled_s > s.window_s for s in own)
        if (stalled_here or self._someone_stalled) and now >= self._next_judge:
            others.read_all()
            self._next_judge = now + max(self.cfg.poll_s, len(others.nodes) / JUDGE_READS_PER_S)
            states = self._every_rank(own, others.records(), now)
        self._note_stragglers(self.node.new_summaries() + others.new_summaries())
        return find_hang(states, attempt=self.attempt, now=now) if states else None

    def _other_nodes(self) -> OtherNodes:
        if self._others is None:
            nodes = self.ack_nodes if self.ack_nodes is not None else range(self.ctx.num_nodes)
            self._others = OtherNodes(self.paths, self.attempt, [n for n in nodes if n != self.ctx.node_rank])
        return self._others

    def _every_rank(
        self, own: list[RankState], entries: dict[int, dict[str, Any]], now: float
    ) -> list[RankState]:
        """Every rank's state: this node's as seen here, the others' as their agents judged them
        (their stall on their own clock; the window again with this run's checkpoint scale)."""
        mine = {s.rank: s for s in own}
        states = []
        for rank in range(self.world_size):
            entry = entries.get(rank)
            if rank in mine:
                states.append(mine[rank])
            elif entry is None:
                states.append(self._state(rank, None, now))
            else:
                rec = ProgressRecord.from_json(entry)
                window = max(float(entry.get("window_s") or 0), self._window(rec))
                stalled = float(entry.get("stalled_s") or 0)
                states.append(RankState(rank, rec.node, rec.step, rec.phase, rec.waiting, stalled, window))
        return states

    # ---- a hang: evidence, then stop ---------------------------------------------------------

    def _respond(self, verdict: Verdict, pids: list[int]) -> None:
        print(f"hpclaunch: watchdog: {verdict.reason}; dumping stacks", file=sys.stderr, flush=True)
        try:
            self._gather_evidence(verdict, pids)
        except OSError as e:  # evidence is worth a lot, but never a run that stays hung
            print(f"hpclaunch: watchdog: gathering the evidence failed: {e}", file=sys.stderr, flush=True)
        finally:
            stop_workers(pids)

    def _gather_evidence(self, verdict: Verdict, pids: list[int]) -> None:
        began = time.time()
        by_pid = {int(r["pid"]): rank for rank, r in self._records.items() if isinstance(r.get("pid"), int)}
        dumped = dump_stacks(
            self.paths,
            self.attempt,
            pids,
            verdict.reason,
            wait_s=self.cfg.dump_wait_s,
            ranks_by_pid=by_pid or None,
        )
        traces = (
            trigger_flight_recorder(self.paths, self.attempt, sorted(dumped), self.cfg.dump_wait_s)
            if self.nccl
            else []
        )
        atomic_write_json(self._ack(self.ctx.node_rank), {"stacks": dumped, "flight_recorder": traces})
        # (the others read the verdict once per ``follow_s``, then dump as long as this node did)
        self._wait_for_nodes(deadline=began + self.cfg.dump_wait_s + self.cfg.poll_s + self.follow_s + 5)
        if self.lead:
            logs = self.paths.attempt_logs(self.attempt)
            stacks = sorted(
                str(p.relative_to(self.paths.root)) for p in logs.glob("rank*.stacks.txt") if file_size(p)
            )
            recorder: Any = "not used (gloo)"
            if self.nccl:
                found = sorted(nccl_dump_dir(self.paths, self.attempt).glob(f"{NCCL_TRACE_STEM}*"))
                recorder = [str(p.relative_to(self.paths.root)) for p in found] or "no dump arrived"
            self.ledger.append(
                HANG,
                **verdict.ledger_fields(),
                stacks=stacks,
                flight_recorder=recorder,
                dump_s=round(time.time() - began, 3),
            )

    def _ack(self, node_rank: int) -> Path:
        return self.paths.attempt_dir(self.attempt) / f"hang.node{node_rank}.json"

    def _wait_for_nodes(self, deadline: float) -> None:
        nodes = self.ack_nodes if self.ack_nodes is not None else range(self.ctx.num_nodes)
        others = [self._ack(r) for r in nodes if r != self.ctx.node_rank]
        while others and time.time() < deadline:
            others = [p for p in others if not p.exists()]
            time.sleep(0.1)

    def _note_stragglers(self, lines: list[dict[str, Any]]) -> None:
        if self.tracker is None or not lines:
            return
        for found in self.tracker.feed(lines):
            self.ledger.append(STRAGGLER, **found.fields(), reason=found.describe())
            print(f"hpclaunch: watchdog: {found.describe()}", file=sys.stderr, flush=True)


def read_verdict(paths: RunPaths, attempt: str) -> Verdict | None:
    try:
        return Verdict.from_json(json.loads(hang_file(paths, attempt).read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def startup_hang(
    paths: RunPaths, attempt: str, outcome: AttemptOutcome | None, *, window_s: float
) -> Verdict | None:
    """The smoke test's verdict as a hang: rank 0 wrote an outcome with cause ``hang`` naming the ranks
    that never reached the start-up barrier (``preflight.smoke_timeout_s``, usually shorter than
    ``watchdog.startup_s``, so it is the first to notice). Their node comes from their heartbeats;
    None when they name none or more than one. Node 0's watchdog acts on it as on its own verdicts
    (stacks, then stop: the elastic launch would wait for the hung rank), and the
    agent's decision reads it when the watchdog is off or the ranks ended first."""
    if outcome is None or outcome.status != "failed" or outcome.cause is not Cause.HANG:
        return None
    ranks = tuple(sorted(int(r) for r in outcome.extra.get("ranks") or []))
    records = read_progress(paths, attempt)
    nodes = {records[r].node if r in records else None for r in ranks}
    node = next(iter(nodes)) if len(nodes) == 1 else None
    who = ", ".join(f"rank {r}" + (f" on {records[r].node}" if r in records else "") for r in ranks)
    now = time.time()
    return Verdict(
        attempt=attempt,
        phase="startup",
        step=int(outcome.step or 0),
        culprit=who or "no single culprit known",
        ranks=ranks,
        culprit_node=node,
        reason=outcome.error or f"{who} did not reach the start-up barrier",
        window_s=float(window_s),
        stalled_s=float(window_s),
        stalled_since=now - window_s,
        detected_at=now,
        states=tuple(asdict(records[r]) for r in sorted(records)),
        source="distributed smoke test",
    )
