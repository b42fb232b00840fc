"""``logs -f``: follow an attempt's node log, move on to the next attempt after a requeue, stop
when the run ends. Whether the run has ended comes from the caller, so this module only reads
files."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import typer

from ..rundir import STARTED, RunPaths, read_events


def attempt_log_dirs(paths: RunPaths) -> list[Path]:
    """Attempts' log directories in the order the attempts started (the ledger's), then by time."""
    if not paths.logs.is_dir():
        return []
    found = {d.name: d for d in paths.logs.glob("attempt-*") if d.is_dir()}
    order = [f"attempt-{e.attempt}" for e in read_events(paths).named(STARTED)]
    ordered = [found.pop(name) for name in dict.fromkeys(order) if name in found]
    return ordered + sorted(found.values(), key=lambda d: d.stat().st_mtime)


def copy_out(log: Path, offset: int = 0) -> int:
    """Print ``log`` from ``offset`` to its current end; the new offset."""
    try:
        with open(log, "rb") as f:
            f.seek(offset)
            while chunk := f.read(65536):
                typer.echo(chunk.decode(errors="replace"), nl=False)
                offset += len(chunk)
    except FileNotFoundError:
        pass
    return offset


def follow_logs(
    paths: RunPaths,
    dirs: list[Path],
    index: int,
    node: int,
    *,
    pinned: bool,
    ended: Callable[[], int | None],
    poll_s: float = 0.5,
) -> int:
    """``logs -f``: print attempt ``index``'s log as it grows; on a requeue go on with the next
    attempt's (unless one attempt was asked for); at the run's end print what is left and stop.
    ``ended()``: None while the run is active, else the exit code to end with."""
    offset = copy_out(dirs[index] / f"node{node}.log")
    checked = 0.0
    while True:
        time.sleep(poll_s)
        offset = copy_out(dirs[index] / f"node{node}.log", offset)
        if time.monotonic() - checked < 2.0:
            continue
        checked = time.monotonic()
        dirs = attempt_log_dirs(paths)
        newer = index + 1 < len(dirs)
        if newer and not pinned:
            index, offset = index + 1, 0
            typer.echo(
                f"==> attempt {index + 1} ({dirs[index].name.removeprefix('attempt-')}), node {node} <=="
            )
            offset = copy_out(dirs[index] / f"node{node}.log")
            continue
        code = None if newer else ended()
        if newer or code is not None:
            copy_out(dirs[index] / f"node{node}.log", offset)
            return code or 0
