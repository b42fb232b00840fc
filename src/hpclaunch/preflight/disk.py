"""The ``disk`` check: space and inodes for the checkpoints the run keeps, plus a reserve.

SLURM and PBS, on the login node: the run directory, the checkpoint directory and the job's Python must
be where the compute nodes find them at the same paths; under /tmp, /var/tmp or /dev/shm, or on one of
this machine's own filesystems (ext4, xfs, tmpfs, ...), they are warned about.

Needed at the checkpoint directory: (keep_last + 1 being written + keep_every ones) x checkpoint size
(parameters x 12 bytes: fp32 weights and two AdamW moments) and as many files as DCP writes (one per
rank + metadata + manifest). Needed at the run directory: ``preflight.min_free_disk_gb`` for logs,
metrics and the ledger. Both are measured at the nearest existing parent (the run may not exist yet);
when they share a filesystem the needs add up.
"""

from __future__ import annotations

import os
import sys
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
        if st.f_flag & os.ST_RDONLY or not os.access(need.probe_at, os.W_OK):
            why = "a read-only filesystem" if st.f_flag & os.ST_RDONLY else "no permission to write"
            f.fail(f"{label}: cannot be written ({why})", "put run_dir / checkpoint.dir where you can write")
            continue
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
    if ctx.cfg.scheduler.kind != "local" and not ctx.on_node:
        _shared_with_the_nodes(ctx, f, [("run directory", run_dir), ("checkpoint directory", ckpt_dir)])
    return f.outcome()


# Where a cluster's nodes each have their own: what is written there on the login node, no compute
# node sees.
NODE_LOCAL = (Path("/tmp"), Path("/var/tmp"), Path("/dev/shm"))
# Filesystems of one machine's own disks or memory (a shared filesystem is NFS, Lustre, GPFS, BeeGFS,
# CephFS, ...; an unknown or FUSE type is given the benefit of the doubt).
LOCAL_FILESYSTEMS = frozenset(
    {"ext2", "ext3", "ext4", "xfs", "btrfs", "zfs", "f2fs", "tmpfs", "ramfs", "overlay"}
)
SHARED_HINT = (
    "put run_dir (and checkpoint.dir, the job's Python) on the filesystem the login and compute nodes "
    "share, at the same path (docs/clusters.md, 'On your cluster')"
)


def _shared_with_the_nodes(ctx: CheckContext, f: Findings, paths: list[tuple[str, Path]]) -> None:
    """SLURM/PBS, on the login node: the job runs elsewhere and finds its run directory, checkpoints
    and Python at the same paths, so they must live where the nodes see them. Warnings: a cluster
    where this machine is the only node (the local test clusters) is legitimate."""
    python = Path(ctx.cfg.launch.python or sys.executable)
    warned: set[Path] = set()
    for what, path in [*paths, ("job's Python", python)]:
        where = nearest_existing(path).resolve()
        local = next((p for p in NODE_LOCAL if where == p or p in where.parents), None)
        if local is not None:
            if local not in warned:
                f.warn(
                    f"the {what} {path} is under {local}, which is each node's own: the compute nodes do not "
                    "see what is there on this machine",
                    SHARED_HINT,
                )
            warned.add(local)
            continue
        if what == "job's Python":
            continue  # a local install at the same path on every node is a setup of its own
        mount, fstype = filesystem_of(where)
        if fstype in LOCAL_FILESYSTEMS and mount not in warned:
            f.warn(
                f"the {what} {path} is on {fstype} ({mount}), a filesystem of this machine's own: the "
                "compute nodes must find it at the same path",
                SHARED_HINT,
            )
            warned.add(mount)


def filesystem_of(path: Path, mountinfo: str | None = None) -> tuple[Path, str]:
    """(mount point, filesystem type) of the mount ``path`` lies on (``/proc/self/mountinfo``);
    ``(/, "")`` when it cannot be read."""
    if mountinfo is None:
        try:
            mountinfo = Path("/proc/self/mountinfo").read_text()
        except OSError:
            return Path("/"), ""
    best, fstype = Path("/"), ""
    for line in mountinfo.splitlines():
        fields = line.split()
        if "-" not in fields or len(fields) < 5:
            continue
        point = Path(fields[4].replace("\\040", " "))
        kind = fields[fields.index("-") + 1]
        if (point == path or point in path.parents) and len(point.parts) >= len(best.parts):
            best, fstype = point, kind
    return best, fstype
