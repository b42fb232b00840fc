"""Rank 0's report of a published save: the log line and the ledger's ``checkpoint_saved``.

The same for a blocking save (right after it) and a background one (when it is settled, maybe many
steps later): the training stall it reports is then the one its ``save()`` call measured.
"""

from __future__ import annotations

import logging
import time

from ...rundir import CHECKPOINT_SAVED, Ledger
from .directory import CheckpointDir
from .writing import Published, SaveJob

log = logging.getLogger("hpclaunch.rank.checkpoint")


def report_saved(
    job: SaveJob,
    published: Published | None,
    *,
    checkpoints: CheckpointDir,
    ledger: Ledger | None,
    writer: str,
    background_stall_s: float | None,
) -> None:
    """``published``: rank 0's (the other ranks have nothing to report). ``writer``: the background
    writer's kind; ``background_stall_s``: the stall of the ``save()`` that started a background
    save."""
    if published is None:
        return
    checkpoints.mark_valid(job.step, job.final)  # this process knows it valid without reading it
    stall = background_stall_s if not job.blocking else time.monotonic() - job.started
    how = "blocking" if job.blocking else f"async, {writer} writer"
    log.info(
        "saved checkpoint %s (%.1f MB, %.2f s, %s, training stalled %.3f s)",
        job.final.name,
        published.bytes / 1e6,
        published.seconds,
        how,
        stall or 0.0,
    )
    if ledger is not None:
        ledger.append(
            CHECKPOINT_SAVED,
            step=job.step,
            path=published.path,
            seconds=round(published.seconds, 3),
            bytes=published.bytes,
            blocking=job.blocking,
            stall_s=round(stall, 4) if stall is not None else None,
            writer=None if job.blocking else writer,
        )
