"""The run's event ledger: what happened, when, by whom.

Written by the CLI (submitted, stop_requested, cancelled), the node agents (started,
node_preflight, requeued, finished, failed, ...), the local controller and rank 0 of the trainer
(resumed, checkpoint_saved, stopped, ...). Read by ``status``, ``report``, ``logs`` and the node
agent's decision.

One writer per file. Appends from several hosts to one file are not atomic on NFS or Lustre
(O_APPEND is a local-filesystem promise), so every writing process has its own file
``RUN/events/<role>-<host>-<pid>.jsonl`` and readers merge all files in timestamp order (ties: one
process's events in the order it wrote them, by its sequence number across its files, since a
foreground ``train`` writes the CLI's and the agent's ledgers within one millisecond; then file
name). A line that is not valid JSON (a writer killed in
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
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..fsutil import retry_transient
from .events import Event, parse_event
from .kinds import SUBMIT_FAILED, SUBMITTED, SUBMITTING
from .paths import RunPaths


def latest_submission(events: Sequence[Event]) -> int:
    """Index of the event that opened the run's latest submission (-1: none). That is its
    ``submitting``, not ``submitted``: the job may start, and even end, before ``submit`` hears the
    scheduler's answer and records ``submitted``, and what it recorded meanwhile belongs to this
    submission. A refused submission (``submit_failed``) opened nothing; a ledger without
    ``submitting`` (a foreground ``train``, older runs) is opened by ``submitted``."""
    start, pending = -1, None
    for i, e in enumerate(events):
        kind = e.event
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
        # One write() per line, to a file no other process writes: a reader sees whole lines or,
        # if this process dies mid-write, one torn last line that read_events reports. The folder,
        # the open and the write are tried again together while the filesystem says "not now"
        # (EIO, ESTALE): a decision that cannot be recorded for a moment is recorded a moment later.
        retry_transient(lambda: self._write_line(data))
        return record

    def _write_line(self, data: bytes) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._append_line(data)

    def _append_line(self, data: bytes) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)  # (read: its last byte)
        try:
            size = os.fstat(fd).st_size
            if size and os.pread(fd, 1, size - 1) != b"\n":
                # A try that failed part way left a torn line: it ends here, as a torn line of its
                # own (read_events reports it), and the record starts a whole line of its own.
                data = b"\n" + data
            while data:
                data = data[os.write(fd, data) :]
        finally:
            os.close(fd)

    def events(self) -> list[Event]:
        """The whole run's ledger (every writer's file, merged), typed (``read_events``; its torn
        lines aside)."""
        return read_events(self.paths).events


@dataclass
class EventLog:
    """The merged ledger of a run, and the lines that could not be read (``file:line: why``)."""

    events: list[Event] = field(default_factory=list)
    torn: list[str] = field(default_factory=list)

    def __iter__(self) -> Iterator[Event]:
        return iter(self.events)

    def named(self, *names: str) -> list[Event]:
        return [e for e in self.events if e.event in names]


def ledger_files(paths: RunPaths) -> list[Path]:
    files = sorted(paths.events_dir.glob("*.jsonl")) if paths.events_dir.is_dir() else []
    if paths.legacy_events.exists():
        files.insert(0, paths.legacy_events)
    return files


def read_events(paths: RunPaths) -> EventLog:
    """Every writer's events, merged in timestamp order; torn lines reported, not dropped."""
    log = EventLog()
    keyed: list[tuple[float, str, int, int, str, int, Event]] = []
    for path in ledger_files(paths):
        for lineno, record, problem in _read_lines(path):
            if problem is not None:
                log.torn.append(f"{path.relative_to(paths.root)}:{lineno}: {problem}")
                continue
            assert record is not None
            event = parse_event(record)
            writer = (event.host or "", event.pid or 0, event.seq or 0)
            keyed.append((float(event.ts or 0), *writer, path.name, lineno, event))
    keyed.sort(key=lambda k: k[:6])
    log.events = [k[6] for k in keyed]
    return log


def _read_lines(path: Path) -> Iterable[tuple[int, dict[str, Any] | None, str | None]]:
    try:
        # (read again while the filesystem says "not now": a writer's file missing from the merge
        # would undercount the budgets that the decider reads from it)
        text = retry_transient(lambda: path.read_text(errors="replace"))
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
