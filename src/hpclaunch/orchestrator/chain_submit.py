"""``submit --after RUN``: the login side of a chain (see ``rundir.chain`` for the files).

Before anything is written: the earlier run must be a run (not a sweep's root, not this run) that
has not failed or been cancelled, since the next stage would then never start. After the held
submission: the tie is registered in both run directories, then settled at once, in case the
earlier run ended between the check and the registration (or had already finished: the next stage
is released right away).
"""

from __future__ import annotations

from pathlib import Path

from ..errors import UserInputError
from ..rundir import CHAIN_WAITING, Ledger, RunPaths, read_events
from ..rundir.chain import Follower, Verdict, register, verdict
from ..rundir.readers import RunKind, what_is_at
from ..schedulers.chain_release import settle_followers
from ..templates.shell import quote


def check_after(after: Path, run_root: Path, *, sweep: bool) -> RunPaths:
    """The earlier run's paths; UserInputError (exit 2, nothing written) when it cannot be waited for."""
    there = what_is_at(after)
    if there.kind is RunKind.NONE:
        raise UserInputError(there.describe(), where="--after", hint="name the earlier stage's run directory")
    paths = RunPaths(there.path)
    if paths.root == run_root.resolve():
        raise UserInputError(
            "a run cannot wait for itself", where="--after", hint="name the earlier stage's run"
        )
    if sweep or there.kind is RunKind.SWEEP:
        raise UserInputError(
            f"chains join single runs, not sweeps{': ' + there.describe() if not sweep else ''}",
            where="--after",
            hint="chain after one point of a sweep (runs/NAME/pN-...), and submit sweep points separately",
        )
    v = verdict(read_events(paths).events, paths.root)
    if v.action == "cancel":
        raise UserInputError(
            f"{v.reason}: a run after it would never start; nothing was submitted",
            where="--after",
            hint=f"continue it first (hpclaunch submit --resume {quote(paths.root)}), then chain after it",
        )
    return paths


def register_and_settle(after: RunPaths, run: RunPaths, scheduler: str, job_id: str) -> Verdict:
    """Tie the held job ``job_id`` of ``run`` to ``after``; release or cancel it now when ``after``
    has already ended. Returns the earlier run's verdict as of now."""
    register(after, Follower(run.root, scheduler, job_id), run)
    Ledger(run, role="cli").append(CHAIN_WAITING, after=str(after.root), job_id=job_id)
    Ledger(after, role="cli").append(CHAIN_WAITING, next=str(run.root), job_id=job_id)
    settle_followers(after, by="hpclaunch submit")
    return verdict(read_events(after).events, after.root)
