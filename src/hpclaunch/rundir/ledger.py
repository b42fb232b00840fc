"""The run's event ledger: what happened, when, by whom.

Written by the CLI (submitted, stop_requested, cancelled), the node agents (started,
node_preflight, requeued, finished, failed, ...), the local controller and rank 0 of the trainer
(resumed, checkpoint_saved, stopped, ...). Read by ``status``, ``report``, ``logs`` and the node
agent's decision.

One writer per file. Appends from several hosts to one file are not atomic on NFS or Lustre
(O_APPEND is a local-filesystem promise), so every writing process has its own file
``RUN/events/<role>-<host>-<pid>.jsonl`` and readers merge all files in timestamp order (ties: file
name, then the writer's own sequence number). A line that is not valid JSON (a writer killed in
the middle of a write, a damaged file) is kept as a finding with its file and line number, never
dropped silently.
"""

from __future__ import annotations

import itertools
import json
import os
import socket
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .paths import RunPaths

# Event names, in one place so that writers and readers cannot drift apart.
SUBMITTING = "submitting"  # `submit` is about to ask the scheduler (a job may start before it answers)
SUBMITTED = "submitted"  # the scheduler answered: the job id
SUBMIT_FAILED = "submit_failed"  # the scheduler refused the submission: nothing runs
STOP_DROPPED = "stop_dropped"  # `submit --resume` dropped a stop request left from before
PREFLIGHT_SKIPPED = "preflight_skipped"
STARTED = "started"  # one per node per attempt
NODE_PREFLIGHT = "node_preflight"
NCCL_PRESET = "nccl_preset"
RESUMED = "resumed"  # trainer rank 0: step it continues from (0 = fresh start)
CHECKPOINT_SAVED = "checkpoint_saved"
CHECKPOINT_INVALID = "checkpoint_invalid"
CHECKPOINT_FAILED = "checkpoint_failed"  # trainer rank 0: a save failed (what, and what was done)
# a background save still writing when a stop saved a newer step: dropped, not waited for
CHECKPOINT_SUPERSEDED = "checkpoint_superseded"
CHECKPOINT_WRITER_STARVED = "checkpoint_writer_starved"  # a save restarted at writer_nice (CPU starved)
EXPERIMENT_LOG_FAILED = "experiment_log_failed"  # trainer rank 0: W&B/TensorBoard failed (what was done)
CHECKPOINT_INTERVAL = "checkpoint_interval"  # trainer rank 0: the save interval chosen, and why
STOP_REQUESTED = "stop_requested"
STOP_OVERDUE = "stop_overdue"  # node 0's agent: the stop save overran the kill wait; workers ended
STOPPED = "stopped"  # trainer rank 0: all ranks stopped after `step` and saved
REQUEUED = "requeued"
FINISHED = "finished"
FAILED = "failed"
CANCELLED = "cancelled"
ENDED = "ended"  # node 0's agent: the run stops here by the user's wish (resumable)
HELD = "held"  # an attempt the scheduler started after the run had ended (budget spent): withdrawn
NODE_EXCLUDED = "node_excluded"
NODE_REPLACED = "node_replaced"  # node 0's agent: a hot spare takes a failed node's place in place
REFUSED = "refused"  # an attempt that found another live writer holding the run directory
HANG = "hang"  # node 0's watchdog: a window passed without progress (phase, step, culprit, stacks)
STRAGGLER = "straggler"  # node 0's watchdog: a rank slower than the fastest for several summaries
INITIALIZED = "initialized"  # trainer rank 0: weights taken from another run (train.init_from)
CHAIN_WAITING = "chain_waiting"  # CLI: this run is held until the run it is chained after finishes
CHAIN_RELEASED = "chain_released"  # (both runs) the earlier run finished: the next one released
CHAIN_BLOCKED = "chain_blocked"  # (both runs) the earlier run failed or was cancelled: the next never runs
RESCUE_SUBMITTED = "rescue_submitted"  # a rescue job left behind a job of the run (jobs.rescue)
RESCUE_NOT_SUBMITTED = "rescue_not_submitted"  # the scheduler refused the rescue job: nothing watches
RESCUE = "rescue"  # the rescue job ran: what it found (an undecided attempt, or nothing to do)
RESCUE_CANCELLED = "rescue_cancelled"  # the run ended for good: its waiting rescue jobs withdrawn

# Events that end a run (until `submit --resume` starts it again).
RUN_ENDS = (FINISHED, FAILED, CANCELLED, ENDED, HELD, SUBMIT_FAILED)


def latest_submission(events: list[dict[str, Any]]) -> int:
    """Index of the event that opened the run's latest submission (-1: none). That is its
    ``submitting``, not ``submitted``: the job may start, and even end, before ``submit`` hears the
    scheduler's answer and records ``submitted``, and what it recorded meanwhile belongs to this
    submission. A refused submission (``submit_failed``) opened nothing; a ledger without
    ``submitting`` (a foreground ``train``, older runs) is opened by ``submitted``."""
    start, pending = -1, None
    for i, e in enumerate(events):
        kind = e.get("event")
        if kind == SUBMITTING:
            pending = i
        elif kind == SUBMITTED:
            start, pending = (pending if pending is not None else i), None
        elif kind == SUBMIT_FAILED:
            pending = None
    return pending if pending is not None else start


_seq = itertools.count(1)
_seq_lock = threading.Lock()


def _next_seq() -> int:
    with _seq_lock:
        return next(_seq)


class Ledger:
    """This process's writer of the ledger of one run (``role``: cli, agent, trainer, controller)."""

    def __init__(
        self,
        paths: RunPaths,
        *,
        role: str,
        attempt: str | None = None,
        node: int | None = None,
    ):
        self.paths = paths
        self.role = role
        self.attempt = attempt
        self.node = node
        self.host = socket.gethostname().split(".")[0]
        self.pid = os.getpid()
        name = role if node is None else f"{role}{node}"
        self.path = paths.events_dir / f"{name}-{self.host}-{self.pid}.jsonl"

    def append(self, event: str, **fields: Any) -> dict[str, Any]:
        record: dict[str, Any] = {"ts": round(time.time(), 3), "seq": _next_seq(), "event": event}
        if self.attempt is not None:
            record["attempt"] = self.attempt
        if self.node is not None:
            record["node"] = self.node
        record["host"] = self.host
        record["pid"] = self.pid
        record["writer"] = self.role
        record.update(fields)
        data = (json.dumps(record, default=str) + "\n").encode()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # One write() per line, to a file no other process writes: a reader sees whole lines or,
        # if this process dies mid-write, one torn last line that read_events reports.
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
        return record

    def events(self) -> list[dict[str, Any]]:
        """The whole run's ledger (every writer's file, merged)."""
        return read_events(self.paths).events


@dataclass
class EventLog:
    """The merged ledger of a run, and the lines that could not be read (``file:line: why``)."""

    events: list[dict[str, Any]] = field(default_factory=list)
    torn: list[str] = field(default_factory=list)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.events)

    def named(self, *names: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("event") in names]


def ledger_files(paths: RunPaths) -> list[Path]:
    files = sorted(paths.events_dir.glob("*.jsonl")) if paths.events_dir.is_dir() else []
    if paths.legacy_events.exists():
        files.insert(0, paths.legacy_events)
    return files


def read_events(paths: RunPaths) -> EventLog:
    """Every writer's events, merged in timestamp order; torn lines reported, not dropped."""
    log = EventLog()
    keyed: list[tuple[float, str, int, int, dict[str, Any]]] = []
    for path in ledger_files(paths):
        for lineno, record, problem in _read_lines(path):
            if problem is not None:
                log.torn.append(f"{path.relative_to(paths.root)}:{lineno}: {problem}")
                continue
            assert record is not None
            keyed.append(
                (float(record.get("ts") or 0), path.name, int(record.get("seq") or 0), lineno, record)
            )
    keyed.sort(key=lambda k: k[:4])
    log.events = [k[4] for k in keyed]
    return log


def _read_lines(path: Path) -> Iterable[tuple[int, dict[str, Any] | None, str | None]]:
    try:
        text = path.read_text(errors="replace")
    except OSError as e:
        yield 0, None, f"cannot read ({e.strerror})"
        return
    lines = text.split("\n")
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            last = i == len(lines) and not text.endswith("\n")
            yield i, None, ("torn last line (its writer died mid-write)" if last else "not valid JSON")
            continue
        if not isinstance(obj, dict) or "event" not in obj:
            yield i, None, "not an event record"
            continue
        yield i, obj, None
