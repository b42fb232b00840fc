"""The run directory and its event ledger.

``RUN/events.jsonl`` is append-only, one JSON object per line, written by the CLI (submitted,
cancelled), the node agents (started, node_preflight, stop_requested, requeued, finished, failed)
and rank 0 of the trainer (resumed, checkpoint_saved, checkpoint_invalid, stopped). ``status``,
``logs`` and ``report`` read only this directory plus the scheduler's own state.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..fsutil import append_line, read_jsonl

# Event names, in one place so that writers and readers cannot drift apart.
SUBMITTED = "submitted"
PREFLIGHT_SKIPPED = "preflight_skipped"
STARTED = "started"  # one per node per attempt
NODE_PREFLIGHT = "node_preflight"
RESUMED = "resumed"  # trainer rank 0: step it continues from (0 = fresh start)
CHECKPOINT_SAVED = "checkpoint_saved"
CHECKPOINT_INVALID = "checkpoint_invalid"
STOP_REQUESTED = "stop_requested"
STOPPED = "stopped"  # trainer rank 0: all ranks stopped after `step` and saved
REQUEUED = "requeued"
FINISHED = "finished"
FAILED = "failed"
CANCELLED = "cancelled"
NODE_EXCLUDED = "node_excluded"

# Causes an attempt can end with, kept distinct all the way to `status` (never collapsed into
# "failed"): timeout, preemption, user, cancelled, node_failure, crash, training.


@dataclass(frozen=True)
class RunPaths:
    """Every path inside one run directory."""

    root: Path
    checkpoint_dir: Path | None = None

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def plan(self) -> Path:
        return self.root / "plan.json"

    @property
    def events(self) -> Path:
        return self.root / "events.jsonl"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def checkpoints(self) -> Path:
        return self.checkpoint_dir or self.root / "checkpoints"

    @property
    def control(self) -> Path:
        return self.root / "control"

    @property
    def stop_file(self) -> Path:
        """Written to ask a running attempt to stop and save (content: the cause)."""
        return self.control / "stop"

    @property
    def continue_file(self) -> Path:
        """Present when a user stop should be followed by an automatic continuation."""
        return self.control / "continue"

    @property
    def attempts(self) -> Path:
        """One small JSON per attempt: how the trainer ended (written by rank 0)."""
        return self.root / "attempts"

    @property
    def scheduler_dir(self) -> Path:
        """Scheduler-owned files: submitit folder, job script, local controller state."""
        return self.root / "scheduler"

    def outcome_file(self, attempt: str) -> Path:
        return self.attempts / f"{attempt}.json"

    def node_log(self, attempt: str, node_rank: int) -> Path:
        return self.logs / f"attempt-{attempt}" / f"node{node_rank}.log"

    def ensure(self) -> RunPaths:
        for d in (self.root, self.logs, self.checkpoints, self.control, self.attempts, self.scheduler_dir):
            d.mkdir(parents=True, exist_ok=True)
        return self

    def is_run(self) -> bool:
        return self.plan.exists() or self.events.exists()


class Ledger:
    """Append-only event log of one run."""

    def __init__(self, path: Path, *, attempt: str | None = None, node: int | None = None):
        self.path = Path(path)
        self.attempt = attempt
        self.node = node
        self.host = socket.gethostname()

    def append(self, event: str, **fields: Any) -> dict[str, Any]:
        record: dict[str, Any] = {"ts": round(time.time(), 3), "event": event}
        if self.attempt is not None:
            record["attempt"] = self.attempt
        if self.node is not None:
            record["node"] = self.node
        record["host"] = self.host
        record["pid"] = os.getpid()
        record.update(fields)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        append_line(self.path, _dumps(record))
        return record

    def events(self) -> list[dict[str, Any]]:
        return read_jsonl(self.path)


def _dumps(record: dict[str, Any]) -> str:
    import json

    return json.dumps(record, sort_keys=False, default=str)
