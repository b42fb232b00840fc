"""The trainer's entry point: ``python -m hpclaunch.trainer RUN_DIR`` on every rank (torchrun starts it).

Reads ``RUN_DIR/config.yaml``; optional environment ``HPCLAUNCH_ATTEMPT`` (default "local") and
``HPCLAUNCH_ATTEMPT_CLOCK`` (the attempt's clock, ``rundir.clock``; absent = no deadline). Runs under torchrun (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_* set) or as a single process. Rank 0 writes
``RUN/attempts/<attempt>.json`` (how the attempt ended); every rank exits 0 unless the run failed.
"""

from __future__ import annotations

import os
import re
import sys
import traceback
from contextlib import suppress
from pathlib import Path

import torch.distributed as dist

from ..errors import (
    DataError,
    FilesystemError,
    HpclaunchError,
    PreflightFailed,
    TrainingError,
    debug_enabled,
)
from ..rundir import AttemptOutcome, RunPaths, read_config, write_outcome
from ..rundir.cause import Cause
from ..rundir.clock import AttemptClock
from ..rundir.env import ATTEMPT_VAR, JOIN_STDERR_VAR
from ..rundir.outcome import write_rank_outcome
from .checkpoint.writer_process import prefork as prefork_writer
from .loader import RankDataError
from .loop import Trainer
from .rank_progress import drop_empty_stack_dump, register_stack_dump
from .smoke import StartupHang
from .startup import StartupClock


def _one_line(err: BaseException) -> str:
    if isinstance(err, HpclaunchError):
        return err.one_line()
    # Native errors lead with the C++ source location ("[/__w/pytorch/.../pair.cc:537] Read error
    # ..."): where torch was built, not what happened.
    text = re.sub(r"\[/[^\]\s]+:\d+\]\s*", "", f"{type(err).__name__}: {err}").strip()
    return text.splitlines()[0] if text else type(err).__name__


def main(argv: list[str] | None = None, *, leave_at_once_on_failure: bool = False) -> int:
    """``python -m hpclaunch.trainer RUN_DIR``: train, write the outcome, return the exit code.

    ``leave_at_once_on_failure`` (the rank host's ranks): a rank that failed on its own writes its
    outcome and leaves with ``os._exit``, without the trainer's teardown. After a peer died there
    is nothing left to save, and the teardown (the DataLoader's workers are given 5 s to stop)
    was most of the time between a crash and the next attempt."""
    startup = StartupClock.since_process_start()  # `imports`: process start until now
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0].startswith("-"):
        print("usage: python -m hpclaunch.trainer RUN_DIR", file=sys.stderr)
        return 2
    run_dir = Path(argv[0]).resolve()
    if os.environ.get(JOIN_STDERR_VAR) == "1":
        # Under the node agent: this rank's stderr joins its stdout, so the agent can keep torchrun's
        # own stderr (its failure report) apart from what the ranks print.
        os.dup2(1, 2)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before anything touches cuBLAS
    attempt = os.environ.get(ATTEMPT_VAR) or "local"
    clock = AttemptClock.from_env(os.environ)
    rank = int(os.environ.get("RANK", 0))
    paths = RunPaths(run_dir)
    trainer: Trainer | None = None
    try:
        cfg = read_config(paths)
        paths = RunPaths.of(run_dir, cfg.checkpoint.dir)
        if cfg.checkpoint.async_save and cfg.checkpoint.writer == "process":
            prefork_writer()  # before the rank's first thread (the process group starts some)
        register_stack_dump(cfg, paths, attempt, rank)  # before the process group: start-up hangs too
        trainer = Trainer(cfg, paths, attempt=attempt, clock=clock, startup=startup)
        outcome = trainer.run()
        code = 0
    except (Exception, KeyboardInterrupt) as err:
        # Errors every rank raises together (the NaN guard's verdict, rank 0's data verdict) are
        # reported by rank 0 alone; any other error by the rank that hit it.
        collective = (
            isinstance(err, (TrainingError, DataError))
            and not isinstance(err, RankDataError)
            and trainer is not None
        )
        collective = collective or (isinstance(err, DataError) and trainer is None)
        if rank == 0 or not collective:
            print(f"hpclaunch: training failed: {_one_line(err)}", file=sys.stderr, flush=True)
            if debug_enabled():
                traceback.print_exc()
        step = trainer.counters.step if trainer is not None else 0
        world = trainer.ctx.world_size if trainer is not None else int(os.environ.get("WORLD_SIZE", 1))
        cause = failure_cause(err)
        outcome = AttemptOutcome("failed", cause, step, _one_line(err), world)
        if isinstance(err, StartupHang):
            outcome.extra.update(phase="startup", ranks=list(err.ranks))
        if isinstance(err, TrainingError) and trainer is not None:
            with suppress(Exception):  # best effort: the failure itself is what matters
                outcome = trainer.outcome("failed", cause, _one_line(err))
        code = err.exit_code if isinstance(err, HpclaunchError) else 1
        if not collective:
            _write_outcome(paths, attempt, outcome, rank)
            if leave_at_once_on_failure:
                for stream in (sys.stdout, sys.stderr):
                    with suppress(OSError, ValueError):
                        stream.flush()
                os._exit(code)
            return code
    finally:
        if trainer is not None:
            try:
                trainer.close()
            except Exception as e:  # pragma: no cover - a failing close must not hide the outcome
                print(f"hpclaunch: closing the trainer failed: {_one_line(e)}", file=sys.stderr)
    _write_outcome(paths, attempt, outcome, rank)
    if dist.is_available() and dist.is_initialized():
        # Rank 0 has written the outcome before any rank exits (torchrun stops the others as soon
        # as one exits non-zero).
        dist.barrier(group=trainer.ctx.cpu_group if trainer else None)
        dist.destroy_process_group()
    drop_empty_stack_dump()  # last: a hang up to here still has its file for the watchdog's dump
    return code


def failure_cause(err: BaseException) -> Cause:
    """The outcome's cause of a failed attempt, which decides whether it is retried.

    DATA / TRAINING: the run's own verdict (bad data; non-finite steps, an incompatible or
    unwritable checkpoint) that a retry would repeat. HANG: ranks that never reached the start-up
    barrier (rank 0 names them), continued within scheduler.max_hang_retries like a hang the node
    agent's watchdog catches. FILESYSTEM: the run's files could not be read now (a shared
    filesystem's EIO or ESTALE that outlasted the retries), retried like a crash. CRASH: anything
    else, the smoke test's other failures included (a link that fails or corrupts an all_reduce is
    the machine's fault, not the run's), which the node agent may retry within
    scheduler.max_failure_retries.
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


def _write_outcome(paths: RunPaths, attempt: str, outcome: AttemptOutcome, rank: int) -> None:
    """Rank 0 writes the attempt's outcome; another rank that failed on its own says why beside it
    (rank 0 then sees only its peers go, and the agent reads both: ``rundir.attempt_outcome``)."""
    if rank == 0:
        write_outcome(paths, attempt, outcome)
    elif outcome.status == "failed":
        with suppress(OSError):
            write_rank_outcome(paths, attempt, rank, outcome)
