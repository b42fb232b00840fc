"""Chains of runs: the files that tie a run to the one it waits for, and what the earlier run's
ledger says the next one should do (torch-free, no scheduler calls).

``hpclaunch submit stage2.yaml --after runs/stage1`` submits stage 2 held and registers it with
stage 1. The tie lives in the run directories, not in a scheduler dependency on a job id: stage 1
comes back as other jobs (PBS continuation jobs, SLURM's new job without a bad node) whose ids no
dependency submitted earlier could name.

```
runs/stage1/chain/next/<stage2 name>-<job>.json   {"run", "scheduler", "job_id", "registered"}
runs/stage2/chain/after.json                       {"run", "job_id", "registered"}
runs/stage2/chain/settled-<job>.json               {"action": release|cancel, "reason", "by", "ts"}
runs/stage2/chain/failed-<job>.json                {"tries", "error", "ts"}: a release/cancel that failed
```

Whoever sees stage 1 ended (its node-0 agent after the final decision, the ``submit`` that
registered stage 2 after stage 1 had ended, ``hpclaunch cancel`` of stage 1) settles stage 2: it
first *claims* it by creating ``settled-<job>.json`` with ``link()`` (atomic and exclusive, NFS
too), and only the one that created it releases or cancels the job. So a release happens exactly
once, however many of them race. ``schedulers.chain_release`` carries the verdict out.

A scheduler call that fails (an ``scontrol release`` that times out, after the pass's own retries)
gives the claim back (``give_back``: ``failed-<job>.json`` counts the failed passes, then the claim
file goes), so a later pass (the next ``cancel`` or ``submit --after``) claims it again once its
backoff has passed (``retry_due``), at most ``MAX_PASSES`` times in all: after that the chain says
how to release the job by hand, and nothing calls the scheduler for it again.
"""

from __future__ import annotations

import json
import os
import re
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ..fsutil import atomic_write_json
from .events import Cancelled, Ended, Event, Failed, Finished
from .ledger import latest_submission
from .paths import RunPaths

Action = Literal["wait", "release", "cancel"]


@dataclass(frozen=True)
class Verdict:
    """What the next stage should do, from the earlier run's ledger."""

    action: Action
    reason: str  # the user's words: "runs/stage1 failed (training: ...)"
    state: str  # the earlier run's state: finished | failed | cancelled | stopped | running


@dataclass(frozen=True)
class Follower:
    """A run registered to start when ``after`` has finished."""

    run: Path
    scheduler: str
    job_id: str
    registered: float = 0.0

    @property
    def key(self) -> str:
        return _safe(f"{self.run.name}-{self.job_id}")


def chain_dir(paths: RunPaths) -> Path:
    return paths.root / "chain"


def verdict(events: Sequence[Event], run: Path) -> Verdict:
    """The earlier run's verdict: the first end recorded since its latest submission (from its
    ``submitting``: ``ledger.latest_submission``) decides
    (a ``held`` attempt after it changes nothing). A user stop (``ended``) may be resumed later, so
    the next stage keeps waiting."""
    start = latest_submission(events)
    for e in events[start + 1 :]:
        if isinstance(e, Finished):
            return Verdict("release", f"{run} finished", "finished")
        if isinstance(e, Failed):
            why = e.error or e.reason or "no reason recorded"
            return Verdict("cancel", f"{run} failed ({e.cause or 'failure'}: {why})", "failed")
        if isinstance(e, Cancelled):
            return Verdict("cancel", f"{run} was cancelled", "cancelled")
        if isinstance(e, Ended):
            return Verdict("wait", f"{run} was stopped (resume it with hpclaunch submit --resume)", "stopped")
    return Verdict("wait", f"{run} has not finished", "running")


# ---- registration ------------------------------------------------------------------------------


def register(after: RunPaths, follower: Follower, follower_paths: RunPaths) -> None:
    """Tie ``follower`` to ``after``: the follower's own record, then the earlier run's list."""
    now = time.time()
    atomic_write_json(
        chain_dir(follower_paths) / "after.json",
        {"run": str(after.root), "job_id": follower.job_id, "registered": now},
    )
    atomic_write_json(
        chain_dir(after) / "next" / f"{follower.key}.json",
        {
            "run": str(follower.run),
            "scheduler": follower.scheduler,
            "job_id": follower.job_id,
            "registered": now,
        },
    )


def followers(after: RunPaths) -> list[Follower]:
    """Every run registered after ``after``, oldest first."""
    found = []
    for path in sorted((chain_dir(after) / "next").glob("*.json")):
        data = _read(path)
        if data and data.get("run") and data.get("job_id"):
            found.append(
                Follower(
                    Path(data["run"]),
                    str(data.get("scheduler")),
                    str(data["job_id"]),
                    float(data.get("registered") or 0),
                )
            )
    return sorted(found, key=lambda f: f.registered)


@dataclass(frozen=True)
class Predecessor:
    """``chain/after.json``: the run this one waits for."""

    run: str
    job_id: str | None
    registered: float | None


def predecessor(paths: RunPaths) -> Predecessor | None:
    """``chain/after.json`` of a run submitted with ``--after`` (None otherwise, or when it names
    no run)."""
    data = _read(chain_dir(paths) / "after.json")
    if data is None or not data.get("run"):
        return None
    return Predecessor(str(data["run"]), data.get("job_id"), data.get("registered"))


# ---- the claim ---------------------------------------------------------------------------------


def settled_file(paths: RunPaths, job_id: str) -> Path:
    return chain_dir(paths) / f"settled-{_safe(job_id)}.json"


def claim(follower: Follower, v: Verdict, *, by: str) -> bool:
    """True for exactly one caller per follower job: the one that must release or cancel it."""
    target = settled_file(RunPaths(follower.run), follower.job_id)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".settled.{uuid.uuid4().hex[:12]}")
    record = {"action": v.action, "reason": v.reason, "state": v.state, "by": by, "ts": round(time.time(), 3)}
    tmp.write_text(json.dumps(record) + "\n")
    try:
        os.link(tmp, target)  # atomic, and it fails when someone settled it first
        return True
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)


RETRY_BACKOFF_S = 30.0  # the first retry after this, then twice as long each time
RETRY_BACKOFF_MAX_S = 600.0
MAX_PASSES = 3  # failed passes (each with its own tries) before nobody tries again


def failed_file(paths: RunPaths, job_id: str) -> Path:
    return chain_dir(paths) / f"failed-{_safe(job_id)}.json"


def give_back(follower: Follower, error: str) -> int:
    """The claimer's release or cancel failed: record the try and give the claim back, so that a
    later pass retries. Returns how many tries have failed."""
    paths = RunPaths(follower.run)
    failed = failures(paths, follower.job_id)
    tries = (failed.tries if failed is not None else 0) + 1
    atomic_write_json(
        failed_file(paths, follower.job_id), {"tries": tries, "error": error, "ts": round(time.time(), 3)}
    )
    settled_file(paths, follower.job_id).unlink(missing_ok=True)
    return tries


@dataclass(frozen=True)
class SettleFailures:
    """``failed-<job>.json``: how many tries to release or cancel a follower failed, the last error."""

    tries: int
    error: str | None
    ts: float


def failures(paths: RunPaths, job_id: str) -> SettleFailures | None:
    """The failed tries to settle ``job_id`` (None: none failed); kept once a retry succeeded."""
    data = _read(failed_file(paths, job_id))
    if data is None:
        return None
    return SettleFailures(int(data.get("tries") or 0), data.get("error"), float(data.get("ts") or 0))


def retry_due(paths: RunPaths, job_id: str, *, now: float | None = None) -> bool:
    """Whether a follower whose settling failed may be tried again now (backoff doubling per try)."""
    failed = failures(paths, job_id)
    if failed is None:
        return True
    if failed.tries >= MAX_PASSES:
        return False  # given up: the chain says how to release it by hand
    tries = max(1, failed.tries or 1)
    wait = min(RETRY_BACKOFF_MAX_S, RETRY_BACKOFF_S * 2 ** (tries - 1))
    return (now if now is not None else time.time()) >= failed.ts + wait


@dataclass(frozen=True)
class Settlement:
    """``settled-<job>.json``: the claim on a follower, and what its claimer was to do."""

    action: str | None  # release | cancel
    reason: str | None
    state: str | None
    by: str | None


def settlement(paths: RunPaths, job_id: str) -> Settlement | None:
    data = _read(settled_file(paths, job_id))
    if data is None:
        return None
    return Settlement(data.get("action"), data.get("reason"), data.get("state"), data.get("by"))


def _read(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", text)[:120]
