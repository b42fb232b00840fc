"""Carrying out a chain's verdict: the next stage's held job is released or cancelled through its
own scheduler, exactly once (``rundir.chain`` holds the files and the claim).

Called wherever the earlier run may have ended: its node-0 agent after every attempt
(``jobs.chain``), ``submit --after`` right after it registered the next stage (the earlier run
may have ended meanwhile), ``hpclaunch cancel`` of the earlier run, and ``hpclaunch status`` of
either run (``settle_around``: where a failed call is retried). Each call reads the earlier run's
ledger; while it has not ended, nothing happens. A follower's scheduler call that fails is tried
again at once (``RETRY_NOW_S``), then recorded in its ledger (``chain_blocked`` with the error and
``retry: true``) and its claim given back, so a later pass tries again after a backoff; it never
raises: the caller is usually an agent deciding another run's fate, which must not change.
"""

from __future__ import annotations

import time

from ..errors import HpclaunchError
from ..rundir import CANCELLED, CHAIN_BLOCKED, CHAIN_RELEASED, Ledger, RunPaths, read_events
from ..rundir.chain import (
    Follower,
    Verdict,
    claim,
    failures,
    followers,
    give_back,
    predecessor,
    retry_due,
    verdict,
)
from .registry import get_scheduler

RETRY_NOW_S = (1.0, 3.0)  # pauses between the tries of one pass (a scheduler's brief timeout)


def settle_followers(
    after: RunPaths, *, by: str, pauses: tuple[float, ...] = RETRY_NOW_S
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


def settle_around(paths: RunPaths, *, by: str) -> None:
    """The runs chained after ``paths``, and ``paths`` itself if it waits for another run: settled
    if their earlier run has ended (a release that failed before is retried here, once per pass:
    a `status` must not wait out several scheduler timeouts). Never raises."""
    import contextlib
    from pathlib import Path

    with contextlib.suppress(OSError):
        settle_followers(paths, by=by, pauses=())
        before = predecessor(paths)
        if before is not None:
            after = RunPaths(Path(before.run))
            if after.is_run():
                settle_followers(after, by=by, pauses=())


def carry_out(
    after: RunPaths, follower: Follower, v: Verdict, *, by: str, pauses: tuple[float, ...] = RETRY_NOW_S
) -> None:
    """Release or cancel one claimed follower; both runs' ledgers say what was done and why."""
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
        fields["tries"] = give_back(follower, str(fields["error"]))
        fields["retry"] = True  # by the next status of either run, or another agent
    mine.append(event, **fields)
    theirs.append(event, next=str(follower.run), **{k: v for k, v in fields.items() if k != "after"})


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
