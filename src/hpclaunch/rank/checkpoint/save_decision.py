"""Whether and where a save writes: rank 0 decides, every rank gets its verdict (collective).

Rank 0 keeps a published directory of the step when it is valid (typically the stop save right
after a periodic save of the same step: same state), names the temporary directory and checks that
``extra`` can be stored in the manifest. Its errors are raised on every rank, so none is left
waiting in a collective.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ...errors import CheckpointError
from ...rundir.checkpoint_manifest import _jsonable, step_dir_name
from ..dist import broadcast_json
from .directory import CheckpointDir
from .writing import SaveJob, SaveWriter

log = logging.getLogger("hpclaunch.rank.checkpoint")


@dataclass(frozen=True)
class SaveDecision:
    """Rank 0's verdict on one save, broadcast to every rank as JSON."""

    action: Literal["write", "skip"] = "write"
    nonce: str = ""  # names the temporary directory (and so a generation of writer processes)
    extra: dict[str, Any] = field(default_factory=dict)  # the manifest's, as JSON will store it
    error: str | None = None

    def to_json(self) -> dict[str, object]:
        if self.error is not None:
            return {"error": self.error}
        return {"action": self.action, "nonce": self.nonce, "extra": self.extra}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> SaveDecision:
        if data.get("error"):
            return cls(error=data["error"])
        return cls(data["action"], data["nonce"], data["extra"])


def plan_save(
    step: int,
    writer: SaveWriter,
    *,
    blocking: bool,
    extra: dict[str, Any] | None,
    started: float,
    needed: int,
) -> SaveJob | None:
    """The save every rank agrees on, or None when rank 0 keeps the published one (collective over
    the group of ``writer``, which will write it: its directory, its rank 0 decides)."""
    directory, is_coordinator = writer.directory, writer.is_coordinator
    final = directory / step_dir_name(step)
    mine = decide(writer.checkpoints, final, step, extra).to_json() if is_coordinator else {}
    decision = SaveDecision.from_json(broadcast_json(mine, writer.pg, is_source=is_coordinator))
    if decision.error:
        raise CheckpointError(decision.error)
    if decision.action == "skip":
        if is_coordinator:
            log.info("checkpoint %s already published; not saving it again", final.name)
        return None
    tmp = directory / f".{final.name}.tmp-{decision.nonce}"
    return SaveJob(step, tmp, final, blocking, decision.extra, started, needed)


def decide(checkpoints: CheckpointDir, final: Path, step: int, extra: dict[str, Any] | None) -> SaveDecision:
    """Rank 0's verdict (never raises: an error is part of it, for every rank to raise)."""
    try:
        action = _existing_action(checkpoints, final, step)
        return SaveDecision(action, uuid.uuid4().hex[:12], _jsonable(extra))
    except CheckpointError as e:
        return SaveDecision(error=e.one_line())
    except OSError as e:
        return SaveDecision(error=f"cannot prepare checkpoint {final}: {e}")


def _existing_action(checkpoints: CheckpointDir, final: Path, step: int) -> Literal["write", "skip"]:
    """A published directory of this step is kept when valid, else moved aside and saved again."""
    if not final.exists():
        return "write"
    if checkpoints.is_valid(step, final):
        return "skip"
    return "write"  # is_valid moved it aside
