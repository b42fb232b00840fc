"""The MMDiT trainer's entry point: ``python -m hpclaunch.trainer RUN_DIR`` on every rank (the rank
host runs ``main`` in each rank it forks; a lone process may run it by hand).

Reads ``RUN_DIR/config.yaml``; optional environment ``HPCLAUNCH_ATTEMPT`` (default "local") and
``HPCLAUNCH_ATTEMPT_CLOCK`` (the attempt's clock, ``rundir.clock``; absent = no deadline). Runs as
one of the ranks the rank host started (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_* set) or as a single
process. Rank 0 writes ``RUN/attempts/<attempt>.json`` (how the attempt ended, ``rank.ending``);
every rank exits 0 unless the run failed.
"""

from __future__ import annotations

import os
import sys
import traceback
from contextlib import suppress
from pathlib import Path

import torch.distributed as dist

from ..errors import DataError, HpclaunchError, TrainingError, debug_enabled
from ..rank.checkpoint.writer_process import prefork as prefork_writer
from ..rank.ending import failure_cause, flush_streams, one_line, write_attempt_outcome
from ..rank.progress import drop_empty_stack_dump, register_stack_dump
from ..rank.smoke import StartupHang
from ..rank.startup import StartupClock
from ..rundir import AttemptOutcome, RunPaths, read_config
from ..rundir.clock import AttemptClock
from ..rundir.env import ATTEMPT_VAR, JOIN_STDERR_VAR
from .data.loader import RankDataError
from .loop import Trainer


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
        # Under the node agent: this rank's stderr joins its stdout, so the agent can keep the rank
        # host's own stderr (its replies, the elastic launcher's failure report) apart from what
        # the ranks print.
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
            print(f"hpclaunch: training failed: {one_line(err)}", file=sys.stderr, flush=True)
            if debug_enabled():
                traceback.print_exc()
        step = trainer.counters.step if trainer is not None else 0
        world = trainer.ctx.world_size if trainer is not None else int(os.environ.get("WORLD_SIZE", 1))
        cause = failure_cause(err)
        outcome = AttemptOutcome("failed", cause, step, one_line(err), world)
        if isinstance(err, StartupHang):
            outcome.extra.update(phase="startup", ranks=list(err.ranks))
        if isinstance(err, TrainingError) and trainer is not None:
            with suppress(Exception):  # best effort: the failure itself is what matters
                outcome = trainer.outcome("failed", cause, one_line(err))
        code = err.exit_code if isinstance(err, HpclaunchError) else 1
        if not collective:
            write_attempt_outcome(paths, attempt, outcome, rank)
            if leave_at_once_on_failure:
                flush_streams()
                os._exit(code)
            return code
    finally:
        if trainer is not None:
            try:
                trainer.close()
            except Exception as e:  # pragma: no cover - a failing close must not hide the outcome
                print(f"hpclaunch: closing the trainer failed: {one_line(e)}", file=sys.stderr)
    write_attempt_outcome(paths, attempt, outcome, rank)
    if dist.is_available() and dist.is_initialized():
        # Rank 0 has written the outcome before any rank exits (the elastic launcher stops the
        # others as soon as one exits non-zero).
        dist.barrier(group=trainer.ctx.cpu_group if trainer else None)
        dist.destroy_process_group()
    drop_empty_stack_dump()  # last: a hang up to here still has its file for the watchdog's dump
    return code
