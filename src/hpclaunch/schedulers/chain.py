"""Carrying out a chain's verdict: the next stage's held job is released or cancelled through its
own scheduler, exactly once (``rundir.chain`` holds the files and the claim).

Called wherever the earlier run may have ended: its node-0 agent after every attempt
(``jobs.chain``), ``submit --after`` right after it registered the next stage (the earlier run
may have ended meanwhile), and ``hpclaunch cancel`` of the earlier run. Each call reads the earlier
run's ledger; while it has not ended, nothing happens. A follower's scheduler call that fails is
recorded in its ledger (``chain_blocked`` with the error) instead of raising: the caller is
usually an agent deciding another run's fate, which must not change.
"""

from __future__ import annotations

from ..errors import HpclaunchError
from ..rundir import CANCELLED, CHAIN_BLOCKED, CHAIN_RELEASED, Ledger, RunPaths, read_events
from ..rundir.chain import Follower, Verdict, claim, followers, verdict
from .registry import get_scheduler


def settle_followers(after: RunPaths, *, by: str) -> list[tuple[Follower, Verdict]]:
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
        if claim(follower, v, by=by):
            carry_out(after, follower, v, by=by)
            done.append((follower, v))
    return done


def carry_out(after: RunPaths, follower: Follower, v: Verdict, *, by: str) -> None:
    """Release or cancel one claimed follower; both runs' ledgers say what was done and why."""
    paths = RunPaths(follower.run)
    mine = Ledger(paths, role="chain")
    theirs = Ledger(after, role="chain")
    error = None
    try:
        scheduler = get_scheduler(follower.scheduler)
        if v.action == "release":
            scheduler.release(paths, follower.job_id)
        else:
            # Recorded first, as `hpclaunch cancel` does: the run ends here, cancelled, and says why.
            mine.append(CANCELLED, job_id=follower.job_id, by="chain", reason=v.reason)
            scheduler.cancel(paths, follower.job_id)
    except (HpclaunchError, ValueError) as e:
        error = e.one_line() if isinstance(e, HpclaunchError) else str(e)
    event = CHAIN_RELEASED if v.action == "release" and error is None else CHAIN_BLOCKED
    fields = {"after": str(after.root), "job_id": follower.job_id, "reason": v.reason, "by": by}
    if error is not None:
        fields["error"] = f"could not {v.action} job {follower.job_id}: {error}"
    mine.append(event, **fields)
    theirs.append(event, next=str(follower.run), **{k: v for k, v in fields.items() if k != "after"})
