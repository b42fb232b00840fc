"""The ``data`` check: the shards exist, pair up and hold what the model expects, and there are enough.

Validation itself is the trainer's (``trainer.data.dataset.validate_dataset``, numpy only): every shard's
pairing, dtype and shape from the headers, and the token ids of a few shards read in full. This
check adds what only a planner can say: samples vs one global batch and vs the whole run.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import DataError
from .check_context import CheckContext, Findings, Outcome

VALUE_CHECKED_SHARDS = 4  # shards whose token values are read in full (the rest: headers only)


def check_data(ctx: CheckContext) -> Outcome:
    """Data dirs readable, shard pairs complete, a sample of shards validated, samples vs batch x steps;
    for a script's run: the script and its working directory (it reads its own data)."""
    cfg = ctx.cfg
    if cfg.is_script:
        from .script_check import check_script_files

        return check_script_files(ctx)
    f = Findings()
    for key, raw in (("data.token_dir", cfg.data.token_dir), ("data.latent_dir", cfg.data.latent_dir)):
        d = Path(raw)
        if d.is_dir() and not os.access(d, os.R_OK | os.X_OK):
            f.fail(f"{key} {d} is not readable by this user", "fix the directory's permissions")
    if f.items:
        return f.outcome()
    try:
        from ..shards import validate_dataset
    except ImportError as e:  # the trainer package is incomplete in this install
        f.warn(f"cannot validate shards: {e}", "reinstall hpclaunch")
        return f.outcome()
    try:
        info = validate_dataset(
            cfg.data.token_dir, cfg.data.latent_dir, cfg.model, max_shards=VALUE_CHECKED_SHARDS
        )
    except DataError as e:
        f.fail(e.one_line(), e.hint)
        return f.outcome()
    dc = cfg.data
    if dc.val_token_dir and dc.val_latent_dir:
        try:
            val = validate_dataset(
                dc.val_token_dir, dc.val_latent_dir, cfg.model, max_shards=VALUE_CHECKED_SHARDS
            )
        except DataError as e:
            f.fail(f"validation data: {e.one_line()}", e.hint)
            return f.outcome()
        f.ok(f"validation: {len(val.shards)} shard pair(s), {val.num_samples} samples")
    n = info.num_samples
    batch = cfg.train.global_batch
    wanted = cfg.train.steps * batch
    shards = f"{len(info.shards)} shard pair(s), {n} samples (ids checked in {info.fully_checked})"
    if n < batch:
        f.fail(
            f"{shards}: fewer than one global batch of {batch}",
            "add data or lower train.global_batch",
        )
    elif wanted > n:
        f.ok(f"{shards}; {cfg.train.steps} steps x {batch} = {wanted} samples = {wanted / n:.1f} epochs")
    else:
        f.ok(f"{shards}; the run reads {wanted} ({wanted / n:.0%} of one epoch)")
    return f.outcome()
