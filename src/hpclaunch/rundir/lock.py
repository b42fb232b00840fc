"""The run-directory lock: one writer at a time (a job and its attempts, or a foreground ``train``).

``RUN/lock.json`` names the holder: the job id, the scheduler, the role (``job`` while it waits in
the queue, ``agent`` / ``controller`` / ``train`` for the process that runs it), host, pid, when it
was taken and a heartbeat the running process refreshes. A second ``submit``, ``submit --resume`` or
``train --resume`` on a run whose holder is alive is refused with one line naming it.

Alive means: a holder process on this host that still exists; else a heartbeat younger than
``STALE_AFTER_S``; else a job the scheduler still lists as pending or running (the caller passes
that question in, this module never asks a scheduler itself). Only a holder that is none of these
is stale and may be taken over.

Works on shared filesystems: the lock file is created by ``link()`` of a fully written temporary
file (atomic, and it fails when the lock exists, over NFS too); a stale lock is first renamed aside
(only one contender's rename succeeds); updates replace the file atomically.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

from ..errors import RunLockedError
from ..fsutil import atomic_write_text
from .paths import RunPaths

STALE_AFTER_S = 90.0
HEARTBEAT_EVERY_S = 15.0
PROCESS_ROLES = ("agent", "controller", "train")


@dataclass(frozen=True)
class LockHolder:
    job_id: str
    scheduler: str
    role: str  # job | agent | controller | train
    host: str
    pid: int
    acquired: float
    heartbeat: float

    def describe(self, now: float | None = None) -> str:
        age = (now or time.time()) - self.heartbeat
        who = "foreground train" if self.role == "train" else f"{self.scheduler} job {self.job_id}"
        where = f"{self.role} pid {self.pid} on {self.host}" if self.role in PROCESS_ROLES else "queued"
        return f"{who} ({where}, heartbeat {age:.0f} s ago)"


ActiveCheck = Callable[[LockHolder], bool]


def _this_host() -> str:
    return socket.gethostname().split(".")[0]


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except (FileNotFoundError, IndexError, PermissionError):
        return False


def holder_alive(holder: LockHolder, *, is_active: ActiveCheck | None, now: float | None = None) -> bool:
    """Whether ``holder`` may still write (see the module docstring for the order of the questions)."""
    now = time.time() if now is None else now
    if holder.role in PROCESS_ROLES and holder.host == _this_host():
        return _pid_alive(holder.pid)
    if now - holder.heartbeat < STALE_AFTER_S:
        return True
    if is_active is not None:
        return is_active(holder)
    return False


class RunLock:
    def __init__(self, paths: RunPaths):
        self.paths = paths
        self.path = paths.lock

    def read(self) -> LockHolder | None:
        try:
            data = json.loads(self.path.read_text())
            return LockHolder(**{k: data[k] for k in LockHolder.__dataclass_fields__})
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError):
            # Unreadable: written by something else. Stale by definition (no heartbeat to trust).
            return LockHolder("?", "?", "job", "?", 0, 0.0, 0.0)

    def acquire(self, *, job_id: str, scheduler: str, role: str, is_active: ActiveCheck | None) -> LockHolder:
        """Take the lock or raise RunLockedError naming the live holder."""
        now = time.time()
        mine = LockHolder(job_id, scheduler, role, _this_host(), os.getpid(), now, now)
        for _ in range(5):
            if self._create(mine):
                return mine
            holder = self.read()
            if holder is None:
                continue  # released meanwhile
            if holder_alive(holder, is_active=is_active):
                raise RunLockedError(
                    f"this run is active: {holder.describe()}",
                    where=str(self.paths.root),
                    hint=f"stop it first (hpclaunch stop {self.paths.root}), or wait until it ends",
                )
            self._remove_stale(holder)
        raise RunLockedError("could not take the run-directory lock (contended)", where=str(self.path))

    def set(self, holder: LockHolder) -> None:
        """Replace the holder (the job's own agent adopting its lock, or handing it on)."""
        atomic_write_text(self.path, json.dumps(asdict(holder), indent=2) + "\n")

    def adopt(self, *, job_id: str, role: str) -> LockHolder:
        """The job's running process takes over the lock its submission made (same job id)."""
        now = time.time()
        holder = self.read()
        acquired = holder.acquired if holder is not None else now
        scheduler = holder.scheduler if holder is not None else "?"
        mine = LockHolder(job_id, scheduler, role, _this_host(), os.getpid(), acquired, now)
        self.set(mine)
        return mine

    def heartbeat(self, holder: LockHolder) -> bool:
        """Refresh ``holder``'s heartbeat; False when the lock is no longer ours."""
        current = self.read()
        if current is None or (current.job_id, current.pid, current.host) != (
            holder.job_id,
            holder.pid,
            holder.host,
        ):
            return False
        self.set(replace(current, heartbeat=time.time()))
        return True

    def hand_over(self, holder: LockHolder, job_id: str) -> None:
        """The lock now belongs to the job ``job_id`` (a continuation or a requeue) waiting in the queue."""
        now = time.time()
        self.set(replace(holder, job_id=job_id, role="job", pid=0, heartbeat=now))

    def release(self, holder: LockHolder | None = None) -> None:
        """Remove the lock (only if ``holder`` still holds it, when given)."""
        current = self.read()
        if current is None:
            return
        if holder is not None and (current.job_id, current.pid) != (holder.job_id, holder.pid):
            return
        self._remove_stale(current)

    # ---- internals ----------------------------------------------------------------------------

    def _create(self, holder: LockHolder) -> bool:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".lock.{uuid.uuid4().hex[:12]}")
        tmp.write_text(json.dumps(asdict(holder), indent=2) + "\n")
        try:
            os.link(tmp, self.path)  # atomic; fails if the lock exists
            return True
        except FileExistsError:
            return False
        finally:
            tmp.unlink(missing_ok=True)

    def _remove_stale(self, holder: LockHolder) -> None:
        aside = self.path.with_name(f".lock.stale-{uuid.uuid4().hex[:12]}")
        with contextlib.suppress(FileNotFoundError):  # another contender moved it first
            os.rename(self.path, aside)
            aside.unlink(missing_ok=True)


class Heartbeat:
    """A daemon thread refreshing ``holder``'s heartbeat every ``HEARTBEAT_EVERY_S``."""

    def __init__(self, lock: RunLock, holder: LockHolder, every_s: float = HEARTBEAT_EVERY_S):
        self.lock = lock
        self.holder = holder
        self.every_s = every_s
        self.lost = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hpclaunch-lock", daemon=True)

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                if not self.lock.heartbeat(self.holder):
                    self.lost = True
                    return
            except OSError:
                continue  # a filesystem hiccup: try again at the next beat
