"""The node agent's part in chains: once the decider has recorded how an attempt ended, a run that has
ended (finished, failed, cancelled) releases or cancels the runs chained after it
(``schedulers.chain_release``). An attempt that continues changes nothing: the run has not ended, and its
continuation (a requeue, a PBS continuation job with a new id) reads the same run directory."""

from __future__ import annotations

import sys

from ..rundir import RunPaths
from ..schedulers.chain_release import settle_followers
from .rescue import after_run


def after_attempt(paths: RunPaths) -> None:
    """Settle the runs chained after this one if it has ended; never raises (a run's own outcome
    must not depend on the runs after it)."""
    try:
        for follower, verdict in settle_followers(paths, by="agent"):
            what = "released" if verdict.action == "release" else "cancelled"
            print(
                f"hpclaunch: chain: {what} {follower.run} (job {follower.job_id}): {verdict.reason}",
                file=sys.stderr,
                flush=True,
            )
    except OSError as e:
        print(f"hpclaunch: chain: could not settle the runs after this one: {e}", file=sys.stderr, flush=True)
    after_run(paths)  # and its rescue jobs, which would only start to find nothing to do
