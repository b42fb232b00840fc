"""``testing.trace_steps``: every rank's record of every step, what ``verify-resume`` compares.

``RUN/trace/rank<r>.jsonl`` holds, per attempt, a ``begin`` record (the random state and every
attached object's digest where the loop starts, and where the run resumed from), a ``step`` record
per step (the random state at its start and at its end, each object's digest after it, what the
step logged) and an ``end`` record (the cause, the parameters' digest).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..fsutil import append_line
from .objects import Attached
from .rng import rng_digest

__all__ = ["StepTrace"]


class StepTrace:
    """One rank's trace file, written at the step boundary (never inside a step)."""

    def __init__(self, root: Path, *, rank: int, attempt: str, world_size: int, attached: Attached) -> None:
        self.path = root / "trace" / f"rank{rank}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.attempt, self.world_size, self.attached = attempt, world_size, attached
        self._logged: dict[str, Any] = {}  # the current step's run.log values
        self._rng_begin: dict[str, Any] | None = None

    def begin(self, step: int, resumed_from: str | None) -> None:
        digests = self.attached.digests()  # (collective under FSDP: every rank traces)
        self._write(
            {"kind": "begin", "step": step, "rng": rng_digest(), "objects": digests["objects"],
             "params": digests["params_sha256"], "resumed_from": resumed_from}
        )  # fmt: skip

    def enter(self) -> None:
        """A step starts: its random state, before the script draws anything in it."""
        self._logged = {}
        self._rng_begin = rng_digest()

    def logged(self, values: dict[str, Any]) -> None:
        self._logged.update(values)

    def stepped(self, step: int) -> None:
        """A step ended: the random state now, every attached object's digest, what it logged."""
        self._write(
            {"kind": "step", "step": step, "rng_begin": self._rng_begin, "rng_end": rng_digest(),
             "objects": self.attached.digests(whole=False)["objects"], "logged": dict(self._logged)}
        )  # fmt: skip

    def end(self, step: int, cause: str | None, params: Any) -> None:
        self._write({"kind": "end", "step": step, "cause": cause, "params": params})

    def _write(self, record: dict[str, Any]) -> None:
        record.update(attempt=self.attempt, world_size=self.world_size)
        append_line(self.path, json.dumps(record))
