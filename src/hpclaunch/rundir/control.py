"""Stop requests: the files through which a person and the node agents ask a running attempt to stop.

Two kinds, kept apart so that neither can overwrite the other:

- ``RUN/control/stop``: the user's request (``hpclaunch stop [--continue]``). It carries the user's
  intent (end the run, or continue it after the save) and stays until a decision takes it: a
  scheduler's warning in the same attempt cannot turn it into a requeue, and an attempt that dies
  before honouring it does not lose it (the next one honours it). ``submit --resume`` drops one
  left from before.
- ``RUN/control/stop.<attempt>``: a node agent's relay of the scheduler's warning or SIGTERM, for its
  attempt only. A late write (a node that got the requeue's SIGTERM after node 0 decided) names an
  attempt that is over, so the next attempt never reads it.

The trainer's rank 0 reads both at its stop checks; the deciding agent takes the user's request
atomically (rename) when it decides, so a request written after that applies to the next attempt.
Files written before requests carried these fields (``{"cause": ..., "by": ...}``) still read.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..fsutil import atomic_write_json, take_aside
from .cause import Cause, UnknownCause
from .paths import RunPaths


@dataclass(frozen=True)
class StopRequest:
    cause: Cause
    by: str
    requested_at: float
    attempt: str | None = None  # the attempt it was made for (None: whichever runs)
    continue_: bool = False  # user requests only: continue after the save instead of ending

    def to_json(self) -> dict[str, Any]:
        return {
            "cause": self.cause.value,
            "by": self.by,
            "requested_at": round(self.requested_at, 3),
            "attempt": self.attempt,
            "continue": self.continue_,
        }


def write_user_stop(paths: RunPaths, *, continue_: bool, attempt: str | None, by: str) -> StopRequest:
    """``hpclaunch stop``: ask every rank to stop after the same step and save; the run ends (or,
    with ``continue_``, continues) once the attempt has saved."""
    request = StopRequest(Cause.USER, by, time.time(), attempt, continue_)
    atomic_write_json(paths.stop_file, request.to_json())
    return request


def write_relay_stop(paths: RunPaths, attempt: str, cause: Cause, *, by: str) -> None:
    """A node agent relays the scheduler's stop (``cause``) to the ranks of ``attempt``."""
    current = read_request(paths.relay_stop_file(attempt))
    if current is not None and _stronger_or_equal(current.cause, cause):
        return
    atomic_write_json(paths.relay_stop_file(attempt), StopRequest(cause, by, time.time(), attempt).to_json())


def user_stop(paths: RunPaths) -> StopRequest | None:
    """The user's pending stop request, if any."""
    return read_request(paths.stop_file)


def relay_stop(paths: RunPaths, attempt: str) -> StopRequest | None:
    """The scheduler's stop relayed for ``attempt``, if any."""
    return read_request(paths.relay_stop_file(attempt))


def take_user_stop(paths: RunPaths, attempt: str) -> StopRequest | None:
    """The deciding agent takes the user's request (atomically: a request written after this is
    left for the next attempt). Also clears every relay request, which belong to attempts that are
    over once a decision is made."""
    handled = paths.stop_file.with_name(f"stop.taken.{attempt}.{uuid.uuid4().hex[:8]}")
    taken = read_request(handled) if take_aside(paths.stop_file, handled) else None
    clear_relays(paths)
    return taken


def clear_relays(paths: RunPaths, *, keep: str | None = None) -> None:
    """Remove relay requests (except ``keep``'s): they only ever apply to their own attempt."""
    if not paths.control.is_dir():
        return
    for path in paths.control.glob("stop.*"):
        if path.name.startswith("stop.taken.") or path.name == f"stop.{keep}":
            continue
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def drop_user_stop(paths: RunPaths) -> StopRequest | None:
    """``submit --resume``: a request left from before the run ended is not the new run's."""
    request = read_request(paths.stop_file)
    with contextlib.suppress(FileNotFoundError):
        paths.stop_file.unlink()
    return request


def read_request(path: Path) -> StopRequest | None:
    """The request in ``path``; None when there is none. A file that is there but cannot be read as
    a request is still a request to stop (someone wrote it to stop the run): a user stop."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError:
        return StopRequest(Cause.USER, "unreadable request", 0.0)
    try:
        data = json.loads(text)
        cause = Cause.parse(data.get("cause", "user"))
        if not cause.is_stop:
            raise UnknownCause(f"{cause} is not a stop cause")
        return StopRequest(
            cause,
            str(data.get("by", "")),
            float(data.get("requested_at") or 0.0),
            data.get("attempt"),
            bool(data.get("continue", False)),
        )
    except (json.JSONDecodeError, AttributeError, TypeError, ValueError):
        return StopRequest(Cause.USER, "unreadable request", 0.0)


def _stronger_or_equal(a: Cause, b: Cause) -> bool:
    from .cause import STOP_CODES

    return STOP_CODES.get(a, 0) >= STOP_CODES.get(b, 0)
