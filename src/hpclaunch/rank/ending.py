"""How a rank's attempt ended, in the run directory: the cause of a failure (which decides whether it
is retried), the failure in one line, and the outcome file the node agent reads. The MMDiT trainer's
entry point and a script's runner end the same way."""

from __future__ import annotations

import re
import sys
from contextlib import suppress

import torch.distributed as dist

from ..errors import DataError, FilesystemError, HpclaunchError, PreflightFailed
from ..rundir import AttemptOutcome, RunPaths, write_outcome
from ..rundir.cause import Cause
from ..rundir.outcome import Status, write_rank_outcome
from .dist import DistContext, all_gather_json
from .objects import Attached
from .smoke import StartupHang

__all__ = [
    "failure_cause",
    "flush_streams",
    "gathered_outcome",
    "one_line",
    "peer_lost",
    "write_attempt_outcome",
]


def one_line(err: BaseException) -> str:
    if isinstance(err, HpclaunchError):
        return err.one_line()
    # Native errors lead with the C++ source location ("[/__w/pytorch/.../pair.cc:537] Read error
    # ..."): where torch was built, not what happened.
    text = re.sub(r"\[/[^\]\s]+:\d+\]\s*", "", f"{type(err).__name__}: {err}").strip()
    return text.splitlines()[0] if text else type(err).__name__


def failure_cause(err: BaseException) -> Cause:
    """The outcome's cause of a failed attempt, which decides whether it is retried.

    DATA / TRAINING: the run's own verdict (bad data; non-finite steps, an incompatible or
    unwritable checkpoint) that a retry would repeat. HANG: ranks that never reached the start-up
    barrier (rank 0 names them), continued within scheduler.max_hang_retries like a hang the node
    agent's watchdog catches. FILESYSTEM: the run's files could not be read now (a shared
    filesystem's EIO or ESTALE that outlasted the retries), retried like a crash. CRASH: anything
    else, the smoke test's other failures included (a link that fails or corrupts an all_reduce is
    the machine's fault, not the run's), and any error of a user's script (a crash is retried
    within scheduler.max_failure_retries), which the node agent may retry.
    """
    if isinstance(err, DataError):
        return Cause.DATA
    if isinstance(err, StartupHang):
        return Cause.HANG
    if isinstance(err, FilesystemError):
        return Cause.FILESYSTEM
    if isinstance(err, PreflightFailed):
        return Cause.CRASH
    if isinstance(err, HpclaunchError) and not peer_lost(err):
        return Cause.TRAINING
    return Cause.CRASH


# What gloo and NCCL say when another rank's process or node is gone (its socket closed, the
# communicator aborted). A survivor's error that says it (a save that failed because a peer died
# in it, wrapped as a CheckpointError) is that peer's crash, retried, not this run's own verdict.
_PEER_LOST = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|remote worker crash|"
    r"NCCL communicator was aborted|NCCL error.*remote process exited|ProcessGroupGloo.*(?:closed|reset)",
    re.IGNORECASE,
)


def peer_lost(err: BaseException) -> bool:
    """``err``, or an error it was raised from, is a lost peer's (see ``_PEER_LOST``)."""
    seen: set[int] = set()
    e: BaseException | None = err
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, dist.DistError):  # torch's own: backend, network, store
            return True
        if _PEER_LOST.search(str(e)):
            return True
        e = e.__cause__ or e.__context__
    return False


def gathered_outcome(
    ctx: DistContext,
    attached: Attached,
    step: int,
    end: tuple[Status, Cause | None, str | None],
    *,
    attempt: str,
    total: int | None,
) -> AttemptOutcome:
    """The attempt's outcome (``end``: status, cause, error) with every rank's step and digests
    (collective: every rank calls it; rank 0's parameters' digest is the run's)."""
    status, cause, error = end
    mine = {"rank": ctx.rank, "step": step, **attached.digests()}
    ranks = list(all_gather_json(mine, ctx.host_group()))
    return AttemptOutcome(
        status=status,
        cause=cause,
        step=step,
        error=error,
        world_size=ctx.world_size,
        extra={
            "attempt": attempt,
            "total_steps": total,
            "params_sha256": ranks[0].get("params_sha256"),
            "ranks": ranks,
        },
    )


def write_attempt_outcome(paths: RunPaths, attempt: str, outcome: AttemptOutcome, rank: int) -> None:
    """Rank 0 writes the attempt's outcome; another rank that failed on its own says why beside it
    (rank 0 then sees only its peers go, and the agent reads both: ``rundir.attempt_outcome``)."""
    if rank == 0:
        write_outcome(paths, attempt, outcome)
    elif outcome.status == "failed":
        with suppress(OSError):
            write_rank_outcome(paths, attempt, rank, outcome)


def flush_streams() -> None:
    for stream in (sys.stdout, sys.stderr):
        with suppress(OSError, ValueError):  # a closed or broken pipe: nothing left to say there
            stream.flush()
