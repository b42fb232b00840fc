"""``testing.stop_at_step`` and ``testing.crash_at_step``: a user's stop or a rank's death after a
chosen step, each once per run (a marker file in ``RUN/attempts``), for tests and verify-resume;
``testing.step_sleep_s``'s seconds for one attempt's steps."""

from __future__ import annotations

import os
from pathlib import Path

from ..config import RunConfig
from ..rundir import RunPaths
from .dist import DistContext

__all__ = ["fire_testing_knobs", "step_sleep_s", "stops_at"]


def fire_testing_knobs(cfg: RunConfig, paths: RunPaths, ctx: DistContext, step: int) -> None:
    """After ``step``: rank 0 writes a user's stop (as ``hpclaunch stop`` does) at
    ``stop_at_step``; the last rank dies (``os._exit``) at ``crash_at_step``."""
    t = cfg.testing
    if t.stop_at_step == step and ctx.is_main and _first_time(paths.attempts, "stop"):
        from ..rundir.control import write_user_stop

        write_user_stop(paths, continue_=False, attempt=None, by="testing.stop_at_step")
    last = ctx.rank == ctx.world_size - 1
    if t.crash_at_step == step and last and _first_time(paths.attempts, "crash"):
        print(f"hpclaunch: testing.crash_at_step: rank {ctx.rank} dies after step {step}", flush=True)
        os._exit(1)


def stops_at(cfg: RunConfig, step: int) -> bool:
    """``stop_at_step`` is this step: every rank agrees right after it (the config is the same on
    all), so the stop lands there however short the steps, not at the next interval's check, which
    a script of 1 ms steps reached only after its last step."""
    return cfg.testing.stop_at_step == step


def step_sleep_s(cfg: RunConfig, *, resumed: bool) -> float:
    """The sleep added to each step of this attempt: none in an attempt that resumed from a
    checkpoint when ``testing.step_sleep_resumed`` is false."""
    t = cfg.testing
    return 0.0 if resumed and not t.step_sleep_resumed else float(t.step_sleep_s)


def _first_time(directory: Path, what: str) -> bool:
    directory.mkdir(parents=True, exist_ok=True)
    try:
        os.close(os.open(directory / f"testing-{what}.fired", os.O_CREAT | os.O_EXCL, 0o644))
    except FileExistsError:
        return False
    return True
