"""The ``disk`` check: space and inodes for the checkpoints the run keeps, plus a reserve.

Needed at the checkpoint directory: (keep_last + 1 being written + keep_every ones) x checkpoint size
(parameters x 12 bytes: fp32 weights and two AdamW moments) and as many files as DCP writes (one per
rank + metadata + manifest). Needed at the run directory: ``preflight.min_free_disk_gb`` for logs,
metrics and the ledger. Both are measured at the nearest existing parent (the run may not exist yet);
when they share a filesystem the needs add up.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from .check_context import CheckContext, Findings, Outcome
from .script_check import SCRIPT_PROBE_S
from .sizes import SCRIPT_STATE_BYTES, human_bytes, human_count, kept_checkpoints, run_checkpoint_bytes


@dataclass
class _Need:
    path: Path  # as configured
    probe_at: Path  # nearest existing parent
    bytes: int
    inodes: int
    what: list[str]


def nearest_existing(path: Path) -> Path:
    p = path.absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def _checkpoint_bytes(ctx: CheckContext) -> tuple[int, bool]:
    """(one checkpoint's bytes, measured or counted?): the MMDiT's from its parameters; a script's
    from what its probe saw at attach (one rank's state x the ranks), else an assumed size."""
    cfg = ctx.cfg
    if not cfg.is_script:
        params, exact = ctx.parameters()
        return run_checkpoint_bytes(cfg, params), exact
    measure = ctx.probe.script_probe(SCRIPT_PROBE_S) if ctx.probe is not None else {}
    state = measure.get("state_bytes")
    if isinstance(state, int) and state > 0:
        return state * cfg.scheduler.world_size, True  # (FSDP shards: an upper bound)
    return SCRIPT_STATE_BYTES, False


def check_disk(ctx: CheckContext) -> Outcome:
    """Free space and inodes at the run and checkpoint directories vs checkpoints kept + reserve."""
    cfg = ctx.cfg
    f = Findings()
    ckpt, exact = _checkpoint_bytes(ctx)
    kept = kept_checkpoints(cfg)
    run_dir = cfg.run_path()
    ckpt_dir = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else run_dir / "checkpoints"
    reserve = int(cfg.preflight.min_free_disk_gb * 1e9)
    files_per_ckpt = cfg.scheduler.world_size + 3

    needs: dict[int, _Need] = {}
    for path, nbytes, inodes, what in (
        (
            run_dir,
            reserve,
            100,
            f"{cfg.preflight.min_free_disk_gb:g} GB reserve (preflight.min_free_disk_gb)" if reserve else "",
        ),
        (
            ckpt_dir,
            ckpt * kept,
            files_per_ckpt * kept,
            f"{kept} checkpoints x {human_bytes(ckpt)}{'' if exact else ' (estimated)'}",
        ),
    ):
        at = nearest_existing(path)
        try:
            dev = os.stat(at).st_dev
        except OSError as e:
            f.fail(f"cannot stat {at}: {e.strerror}", "check the path and its permissions")
            continue
        if dev in needs:
            needs[dev].bytes += nbytes
            needs[dev].inodes += inodes
            needs[dev].what += [what] if what else []
        else:
            needs[dev] = _Need(path, at, nbytes, inodes, [what] if what else [])

    for need in needs.values():
        try:
            st = os.statvfs(need.probe_at)
        except OSError as e:
            f.fail(f"cannot statvfs {need.probe_at}: {e.strerror}")
            continue
        free = st.f_bavail * st.f_frsize
        label = f"{need.path}" + ("" if need.probe_at == need.path.absolute() else f" (at {need.probe_at})")
        detail = " + ".join(need.what)
        if free < need.bytes:
            f.fail(
                f"{label}: {human_bytes(free)} free, needs {human_bytes(need.bytes)} ({detail})",
                "free space, put run_dir / checkpoint.dir on a larger filesystem, or lower checkpoint.keep_last",
            )
        elif st.f_files > 0 and st.f_favail < need.inodes:
            f.fail(
                f"{label}: {st.f_favail} inodes free, needs {need.inodes} ({detail})",
                "delete files on that filesystem or use another one",
            )
        else:
            f.ok(f"{label}: {human_bytes(free)} free, needs {human_bytes(need.bytes)} ({detail})")
    if f.items and all(s.value == "pass" for s, _, _ in f.items) and not cfg.is_script:
        params, counted = ctx.parameters()
        f.ok(f"{human_count(params)} parameters{'' if counted else ' (estimated)'}")
    return f.outcome()
