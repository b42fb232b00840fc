"""How one attempt ended: ``RUN/attempts/<attempt>.json``, written by the trainer's rank 0 and read
by the node agent (to decide what happens next) and by ``status``.

``status``: finished (every step done), stopped (all ranks saved after the same step, for
``cause``), failed (``cause`` says whose verdict: ``training`` and ``data`` are the run's own and
never retried; ``crash`` is anything else). After a clean stop every rank exits 0 (torchrun treats
a non-zero exit as a crash), so this file, not an exit code, carries the story. A missing file
means the trainer never got to write one: a crash.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from ..fsutil import atomic_write_json
from .paths import RunPaths

Status = Literal["finished", "stopped", "failed"]

# Why an attempt ended, kept distinct all the way to `status` (never collapsed into "failed").
STOP_CAUSES = ("timeout", "preemption", "user")
FAILURE_CAUSES = ("crash", "training", "data", "node_failure", "hang")
CAUSES = (*STOP_CAUSES, "cancelled", *FAILURE_CAUSES)


@dataclass
class AttemptOutcome:
    status: Status
    cause: str | None = None
    step: int | None = None
    error: str | None = None
    world_size: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # params hash, per-rank summaries, ...

    def to_json(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "cause": self.cause,
            "step": self.step,
            "error": self.error,
            "world_size": self.world_size,
            **self.extra,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> AttemptOutcome:
        known = {"status", "cause", "step", "error", "world_size"}
        status = data.get("status")
        return cls(
            status=status if status in ("finished", "stopped", "failed") else "failed",
            cause=data.get("cause"),
            step=data.get("step"),
            error=data.get("error"),
            world_size=data.get("world_size"),
            extra={k: v for k, v in data.items() if k not in known},
        )


def write_outcome(paths: RunPaths, attempt: str, outcome: AttemptOutcome) -> None:
    atomic_write_json(paths.outcome_file(attempt), outcome.to_json())


def read_outcome(paths: RunPaths, attempt: str) -> AttemptOutcome | None:
    """The outcome the trainer wrote for ``attempt``; None when it wrote none (or it is unreadable)."""
    try:
        data = json.loads(paths.outcome_file(attempt).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return AttemptOutcome.from_json(data) if isinstance(data, dict) else None


def latest_outcome(paths: RunPaths) -> AttemptOutcome | None:
    """The most recently written outcome of the run (the foreground ``train`` command's verdict)."""
    files = (
        sorted(paths.attempts.glob("*.json"), key=lambda p: p.stat().st_mtime)
        if paths.attempts.is_dir()
        else []
    )
    for path in reversed(files):
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(data, dict):
            return AttemptOutcome.from_json(data)
    return None
