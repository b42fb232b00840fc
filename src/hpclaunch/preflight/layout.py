"""The ``config`` check: the run's layout and its time budget, as far as they can be known before it runs.

It also reports the NCCL variables' warnings (deprecated aliases, names newer than our table): the
config loader refuses only what is certainly wrong, so doubtful settings surface here.

What is exact: ranks, per-rank batch and accumulation (the config loader already refuses a global
batch that does not divide). What is estimated, and said so: the checkpoint size (from the
parameter count, exact when the probe built the model) and its save time (at an assumed
200 MB/s), the startup time (60 s), the step time (unknown, unless ``testing.step_sleep_s`` gives a
lower bound). Doubts are warnings, never failures: they cannot be proven before the run.
"""

from __future__ import annotations

from ..nccl import validate_nccl_env
from .base import CheckContext, Findings, Outcome
from .sizes import (
    ASSUMED_STARTUP_S,
    ASSUMED_WRITE_BPS,
    checkpoint_bytes,
    estimated_save_s,
    human_bytes,
)

MIN_TRAIN_S = 60  # an attempt that trains less than this per time limit mostly restarts


def check_config(ctx: CheckContext) -> Outcome:
    """Layout (nodes x ranks, samples/rank), stop lead vs estimated save time, walltime vs intervals."""
    cfg = ctx.cfg
    s, t, c = cfg.scheduler, cfg.train, cfg.checkpoint
    f = Findings()
    layout = (
        f"{s.nodes} node(s) x {s.nprocs} rank(s) = {s.world_size} ({cfg.backend}), "
        f"{cfg.per_rank_batch} samples/rank"
    )
    if cfg.grad_accum > 1:
        layout += f" ({cfg.micro_batch} x {cfg.grad_accum} accumulation steps)"

    params, exact = ctx.parameters()
    ckpt = checkpoint_bytes(params)
    save_s = estimated_save_s(ckpt)
    est = f"checkpoint {human_bytes(ckpt)}{'' if exact else ' (estimated)'}, ~{save_s:.0f} s to save at an assumed {ASSUMED_WRITE_BPS / 1e6:.0f} MB/s"
    if cfg.launch.stop_lead_s is None:
        lead = int(save_s) + cfg.launch.stop_margin_s
        lead_text = f"stop lead measured at run time (first attempt ~{lead} s: estimated save + margin)"
    else:
        lead = cfg.launch.stop_lead_s
        lead_text = f"stop lead {lead} s"
        if lead < save_s + cfg.launch.stop_margin_s:
            f.warn(
                f"launch.stop_lead_s {lead} may be too short: {est}, plus launch.stop_margin_s "
                f"{cfg.launch.stop_margin_s}",
                "raise launch.stop_lead_s, or leave it null to use the measured save time",
            )

    train_s = s.time_limit_s - lead - ASSUMED_STARTUP_S
    if train_s < MIN_TRAIN_S:
        f.warn(
            f"scheduler.time_limit {s.time_limit} leaves ~{max(train_s, 0)} s of training per attempt "
            f"after startup (~{ASSUMED_STARTUP_S} s, assumed) and the stop lead ({lead} s)",
            "raise scheduler.time_limit: most of each attempt would be spent starting and saving",
        )
    if c.every_steps > t.steps:
        f.warn(
            f"checkpoint.every_steps {c.every_steps} > train.steps {t.steps}: no periodic checkpoint, "
            "a crash loses the whole run (stops and the end still save)",
            f"set checkpoint.every_steps to at most {t.steps}",
        )
    if cfg.testing.step_sleep_s > 0:
        interval = c.every_steps * cfg.testing.step_sleep_s
        if interval > max(train_s, 0):
            f.warn(
                f"one checkpoint interval takes at least {interval:.0f} s (every_steps x testing.step_sleep_s), "
                f"more than the ~{max(train_s, 0)} s an attempt trains: periodic saves never happen "
                "and each attempt relies on its stop save",
                "lower checkpoint.every_steps or raise scheduler.time_limit",
            )
    for issue in validate_nccl_env(cfg.nccl.env):
        hint = f"use {issue.replacement}" if issue.replacement else "see 'hpclaunch nccl presets'"
        (f.fail if issue.severity == "error" else f.warn)(f"nccl.env.{issue}", hint)
    f.ok(f"{layout}; {lead_text}; {est}")
    return f.outcome()
