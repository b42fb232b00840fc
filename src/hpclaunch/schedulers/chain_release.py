"""Carrying out a chain's verdict: the next stage's held job is released or cancelled through its
own scheduler, exactly once (``rundir.chain`` holds the files and the claim).

Called wherever the earlier run may have ended: its deciding agent after its last decision
(``jobs.chain_end``), ``submit --after`` right after it registered the next stage (the earlier run may
have ended meanwhile) and ``hpclaunch cancel`` of the earlier run. Never by ``status``: looking at
a run changes nothing in a scheduler. Each call reads the earlier run's ledger; while it has not
ended, nothing happens. A follower's scheduler call that fails is tried again within the pass
(``RETRY_NOW_S``: about 40 s, a scheduler's brief outage), then the claim is given back and both
ledgers say so once (``chain_blocked``, ``retry: true``), for a later pass (the next ``cancel`` or
``submit --after``); after ``MAX_PASSES`` failed passes nothing tries again, and the last record
(``retry: false``) says how to release the job by hand. It never raises: the caller is usually an
agent deciding another run's fate, which must not change.
"""

from __future__ import annotations

import time

from ..errors import HpclaunchError
from ..rundir import CANCELLED, CHAIN_BLOCKED, CHAIN_RELEASED, Ledger, RunPaths, read_events
from ..rundir.chain import (
    MAX_PASSES,
    Follower,
    Verdict,
    claim,
    failures,
    followers,
    give_back,
    retry_due,
    verdict,
)
from .registry import get_scheduler

RETRY_NOW_S = (2.0, 5.0, 10.0, 20.0)  # pauses between the tries of one pass (a scheduler's brief outage)


def settle_followers(
    after: RunPaths, *, by: str, pauses: tuple[float, ...] | None = None
) -> list[tuple[Follower, Verdict]]:
    """Release (``after`` finished) or cancel (it failed or was cancelled) every run registered
    after it that nobody has settled yet; returns what this call did."""
    registered = followers(after)
    if not registered:
        return []
    v = verdict(read_events(after).events, after.root)
    if v.action == "wait":
        return []
    done = []
    for follower in registered:
        if retry_due(RunPaths(follower.run), follower.job_id) and claim(follower, v, by=by):
            carry_out(after, follower, v, by=by, pauses=pauses)
            done.append((follower, v))
    return done


def carry_out(
    after: RunPaths, follower: Follower, v: Verdict, *, by: str, pauses: tuple[float, ...] | None = None
) -> None:
    """Release or cancel one claimed follower; both runs' ledgers say what was done and why.
    ``pauses``: between the tries within this pass (``RETRY_NOW_S``, read when called)."""
    pauses = RETRY_NOW_S if pauses is None else pauses
    paths = RunPaths(follower.run)
    mine = Ledger(paths, role="chain")
    theirs = Ledger(after, role="chain")
    if v.action == "cancel" and failures(paths, follower.job_id) is None:
        # Recorded first, as `hpclaunch cancel` does: the run ends here, cancelled, and says why.
        mine.append(CANCELLED, job_id=follower.job_id, by="chain", reason=v.reason)
    error = None
    for pause in (*pauses, None):
        error = _call(paths, follower, v)
        if error is None or pause is None:
            break
        time.sleep(pause)
    event = CHAIN_RELEASED if v.action == "release" and error is None else CHAIN_BLOCKED
    fields: dict[str, object] = {
        "after": str(after.root),
        "job_id": follower.job_id,
        "reason": v.reason,
        "by": by,
    }
    if error is not None:
        fields["error"] = f"could not {v.action} job {follower.job_id}: {error}"
        tries = give_back(follower, str(fields["error"]))
        fields["tries"] = tries
        fields["retry"] = tries < MAX_PASSES  # by the next cancel or submit --after
        if tries >= MAX_PASSES:
            fields["hint"] = by_hand(follower, v)
    mine.append(event, **fields)
    theirs.append(event, next=str(follower.run), **{k: v for k, v in fields.items() if k != "after"})


def by_hand(follower: Follower, v: Verdict) -> str:
    """The command that settles a follower nobody will try again."""
    verb = {"slurm": ("scontrol release", "scancel"), "pbs": ("qrls", "qdel")}.get(follower.scheduler)
    if verb is None:
        return f"{v.action} job {follower.job_id} with its scheduler's own command"
    return f"{verb[0] if v.action == 'release' else verb[1]} {follower.job_id}"


def _call(paths: RunPaths, follower: Follower, v: Verdict) -> str | None:
    """Release or cancel the follower's job through its scheduler; the error in one line, or None."""
    try:
        scheduler = get_scheduler(follower.scheduler)
        if v.action == "release":
            scheduler.release(paths, follower.job_id)
        else:
            scheduler.cancel(paths, follower.job_id)
    except (HpclaunchError, ValueError) as e:
        return e.one_line() if isinstance(e, HpclaunchError) else str(e)
    return None
