"""One rank's run as the training loop's parts read it (``reports``, ``saving``, ``resume``): the
config, the distributed context, the run directory and attempt, rank 0's ledger and the counters, in
one record the loop builds once its ledger is open."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import RunConfig
from ..rank.dist import DistContext
from ..rundir import Ledger, RunPaths
from .counters import Counters


@dataclass(frozen=True)
class RankRun:
    cfg: RunConfig
    ctx: DistContext
    paths: RunPaths
    attempt: str
    ledger: Ledger | None  # rank 0's; None on the other ranks
    counters: Counters  # (the loop's, updated in place as it steps)
