"""A user's training script as one rank of an hpclaunch run (``script.path``): what the rank host
runs in each rank it forks for a script's run.

The rank begins its session first (progress for the watchdog, stop signals that only set a flag),
then runs the script as ``__main__`` with ``sys.argv`` = [script, *script.args], its directory first
on ``sys.path`` and ``script.workdir`` as the working directory, in the environment torchrun gives
(RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ...): a script written for
torchrun runs unchanged. How it ended becomes the attempt's outcome (``ending``):

- its ``run.steps`` loop ran to the end (and the script returned): finished;
- ``hpclaunch.Stopped`` left it (the ranks agreed to stop, the state is saved): stopped, for the
  cause agreed on;
- an exception, or ``sys.exit`` with a non-zero code: failed (``ending.failure_cause``: an error of
  the script is a crash, retried in place within ``scheduler.max_failure_retries``).

The outcome that needs every rank (their digests) is taken by the run at its end, while the
script's process group still exists (a script may destroy it after its loop).
"""

from __future__ import annotations

import os
import runpy
import sys
import traceback
from pathlib import Path

from ..errors import HpclaunchError, debug_enabled
from ..rundir import AttemptOutcome, RunPaths, read_config
from ..rundir.clock import AttemptClock
from ..rundir.env import ATTEMPT_VAR, JOIN_STDERR_VAR
from . import attach as attaching
from . import session as sessions
from .checkpoint.writer_process import prefork as prefork_writer
from .ending import failure_cause, flush_streams, one_line, write_attempt_outcome
from .progress import drop_empty_stack_dump
from .run import Run, Stopped
from .site import RankSite
from .startup import StartupClock

__all__ = ["main"]


def main(argv: list[str], *, leave_at_once_on_failure: bool = False) -> int:
    """Run the script of the run in ``argv[0]`` as this rank; write the outcome; the exit code."""
    startup = StartupClock.since_process_start()
    if os.environ.get(JOIN_STDERR_VAR) == "1":
        os.dup2(1, 2)  # (the agent keeps the launcher's own stderr apart from what the ranks print)
    root = Path(argv[0]).resolve()
    attempt = os.environ.get(ATTEMPT_VAR) or "local"
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    paths = RunPaths(root)
    code = 0
    try:
        cfg = read_config(paths)
        paths = RunPaths.of(root, cfg.checkpoint.dir)
        if cfg.checkpoint.async_save and cfg.checkpoint.writer == "process":
            # Before the session's threads and the script's process group, as the trainer does: the
            # first writer is forked with the rank's imports instead of started to import torch
            # itself (~2 core-s a rank, every attempt).
            prefork_writer()
        site = RankSite(
            paths=paths, cfg=cfg, attempt=attempt, clock=AttemptClock.from_env(os.environ), managed=True
        )
        sessions.begin(site, startup=startup)
        _run_script(str(cfg.script.path), list(cfg.script.args), cfg.script.workdir)
        outcome = _finished(attaching._attached, world)
    except Stopped as stopped:
        run = attaching._attached
        outcome = (run.outcome_record if run is not None else None) or AttemptOutcome(
            "stopped", stopped.cause, stopped.step, None, world
        )
    except (Exception, KeyboardInterrupt, SystemExit) as err:
        if isinstance(err, SystemExit) and err.code in (0, None):
            outcome = _finished(attaching._attached, world)
        else:
            outcome, code = _failed(err, world)
            print(f"hpclaunch: the script failed: {outcome.error}", file=sys.stderr, flush=True)
            if debug_enabled() or not isinstance(err, (HpclaunchError, SystemExit)):
                traceback.print_exc()
            write_attempt_outcome(paths, attempt, outcome, rank)
            if leave_at_once_on_failure:
                flush_streams()
                os._exit(code)
            _close()
            return code
    write_attempt_outcome(paths, attempt, outcome, rank)
    _close(barrier=True)
    drop_empty_stack_dump()
    return code


def _run_script(path: str, args: list[str], workdir: str | None) -> None:
    import multiprocessing

    script = Path(path)
    # The rank was forked by the rank host's forkserver, which made forkserver its start method:
    # a DataLoader's workers would then run the script again from the top in each worker (as
    # spawn does). Under torchrun a script's helpers fork, as Python's default on Linux has them.
    multiprocessing.set_start_method("fork", force=True)
    if workdir:
        os.chdir(workdir)
    sys.argv = [str(script), *args]
    sys.path.insert(0, str(script.parent))  # as `python script.py` does
    runpy.run_path(str(script), run_name="__main__")


def _finished(run: Run | None, world: int) -> AttemptOutcome:
    """The script returned. Its run's own record when its loop finished (or stopped: a script that
    caught ``Stopped`` and returned); else what is known without the other ranks."""
    if run is not None and run.outcome_record is not None:
        return run.outcome_record
    step = run.step if run is not None else 0
    size = run.world_size if run is not None else world
    return AttemptOutcome(
        "finished", None, step, None, size, extra={"loop": "not finished" if run else "no attach"}
    )


def _failed(err: BaseException, world: int) -> tuple[AttemptOutcome, int]:
    run = attaching._attached
    step = run.step if run is not None else 0
    size = run.world_size if run is not None else world
    if isinstance(err, SystemExit):
        text = f"the script exited with code {err.code}"
        return AttemptOutcome("failed", failure_cause(RuntimeError(text)), step, text, size), 1
    code = err.exit_code if isinstance(err, HpclaunchError) else 1
    return AttemptOutcome("failed", failure_cause(err), step, one_line(err), size), code


def _close(*, barrier: bool = False) -> None:
    """The run's writers and the session go; after an orderly end every rank waits for the others
    (rank 0 has written the outcome before any rank exits)."""
    run = attaching._attached
    if run is not None:
        run.close()
    import torch.distributed as dist

    if barrier and dist.is_available() and dist.is_initialized():
        try:
            group = run.ctx.host_group() if run is not None else None
            dist.barrier(group=group)
            dist.destroy_process_group()
        except Exception:  # (a group the script tore down in part: nothing left to wait for)
            pass
    sessions.end()
