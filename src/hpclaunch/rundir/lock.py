"""The run-directory lock: one writer at a time (a job and its attempts, or a foreground ``train``).

``RUN/lock.json`` names the holder: the job id, the scheduler, the role (``job`` while it waits in
the queue, ``agent`` / ``controller`` / ``train`` for the process that runs it), host, pid, when it
was taken and a heartbeat that every running holder refreshes (``Heartbeat``: the node agent, the
local controller and a foreground ``train`` alike). A second ``submit``, ``submit --resume`` or
``train --resume`` on a run whose holder is alive is refused with one line naming it.

Alive (``liveness``), asked in this order:
1. a holder process on this host that still exists (or not: a dead pid is certain);
2. a heartbeat younger than ``STALE_AFTER_S`` (holders on other hosts, seen over a shared
   filesystem);
3. a queued or silent job: the scheduler is asked (the caller passes that question in, this module
   never asks a scheduler itself). A scheduler that cannot answer (``None``: slurmctld down) is
   "assume alive, and say so", never "not active".
A lock file that cannot be parsed (written by something else, truncated) has no heartbeat to
trust: its modification time stands in, so it goes stale like any silent holder instead of
blocking the run forever. One that cannot be *read* now (EIO, ESTALE) is read again.

Works on shared filesystems: the lock file is created by ``link()`` of a fully written temporary
file (atomic, and it fails when the lock exists, over NFS too). A stale lock is taken over by one
contender only: each contender first creates ``lock.json.takeover-<fingerprint of the stale
holder>`` the same way; only the one whose link succeeds replaces the lock, the others find the
winner's fresh lock when they read again. Updates replace the file atomically.

Every read-modify-write of the lock (heartbeat, hand-over, release, adoption, the takeover's write)
is a compare-and-swap: it runs while holding ``lock.json.writing``, a mutex created the same way
(``link()``), so a heartbeat that read "mine" cannot write that back over a hand-over or a release
made since. Not ``flock``: over NFS it depends on lockd (and on Lustre on a mount option), and a
lock lost with a client goes unnoticed; ``link()`` is atomic on every shared filesystem we meet,
and NFS's close-to-open consistency makes the read after taking the mutex see the last write. A
mutex whose holder died inside its few milliseconds is broken by a waiter that saw the same token
in it for ``MUTEX_STALE_S`` on its own monotonic clock (or whose holder's pid is gone on this host).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from ..errors import RunLockedError
from ..fsutil import atomic_write_text, create_exclusive, retry_transient, unique_suffix
from .paths import RunPaths

STALE_AFTER_S = 90.0
# How often a holder refreshes its heartbeat (HPCLAUNCH_LOCK_HEARTBEAT_S: tests watch it beat).
HEARTBEAT_EVERY_S = float(os.environ.get("HPCLAUNCH_LOCK_HEARTBEAT_S") or 15.0)
PROCESS_ROLES = ("agent", "controller", "train")
UNREADABLE = "?"  # job id and scheduler of a lock file that cannot be parsed
# The update mutex: a critical section is one read and one rename, so a token unchanged this long
# (seen on the waiter's own clock) belongs to a holder that died; a waiter gives up after GIVE_UP.
MUTEX_STALE_S = 30.0
MUTEX_GIVE_UP_S = MUTEX_STALE_S + 15.0
MUTEX_POLL_S = 0.05


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
        if self.job_id == UNREADABLE:
            return f"an unreadable lock file (last written {age:.0f} s ago)"
        who = "foreground train" if self.role == "train" else f"{self.scheduler} job {self.job_id}"
        where = f"{self.role} pid {self.pid} on {self.host}" if self.role in PROCESS_ROLES else "queued"
        return f"{who} ({where}, heartbeat {age:.0f} s ago)"

    def fingerprint(self) -> str:
        """Names this very holder record (a takeover of it is keyed by it)."""
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]


# "Is this job still pending or running?": True / False, or None when the scheduler cannot say.
ActiveCheck = Callable[[LockHolder], "bool | None"]


@dataclass(frozen=True)
class Liveness:
    alive: bool
    why: str  # in words, for the refusal or the takeover's record


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


def _holder_gone_here(token: str) -> bool:
    """The update mutex's holder ran on this host and its pid is gone (certain, no waiting)."""
    try:
        who = json.loads(token)
        return bool(who["host"] == _this_host() and not _pid_alive(int(who["pid"])))
    except (ValueError, KeyError, TypeError):
        return False


def liveness(holder: LockHolder, *, is_active: ActiveCheck | None, now: float | None = None) -> Liveness:
    """Whether ``holder`` may still write, and why (see the module docstring for the order)."""
    now = time.time() if now is None else now
    if holder.role in PROCESS_ROLES and holder.host == _this_host():
        alive = _pid_alive(holder.pid)
        return Liveness(alive, f"pid {holder.pid} on this host {'runs' if alive else 'is gone'}")
    if now - holder.heartbeat < STALE_AFTER_S:
        return Liveness(True, f"its heartbeat is {now - holder.heartbeat:.0f} s old")
    if is_active is None or holder.job_id in ("", UNREADABLE):
        return Liveness(False, f"no heartbeat for {now - holder.heartbeat:.0f} s")
    active = is_active(holder)
    if active is None:
        return Liveness(
            True,
            f"{holder.scheduler} cannot be asked whether job {holder.job_id} is alive; assuming it is",
        )
    return Liveness(
        active, f"{holder.scheduler} {'lists' if active else 'no longer runs'} job {holder.job_id}"
    )


def holder_alive(holder: LockHolder, *, is_active: ActiveCheck | None, now: float | None = None) -> bool:
    return liveness(holder, is_active=is_active, now=now).alive


class RunLock:
    def __init__(self, paths: RunPaths):
        self.paths = paths
        self.path = paths.lock

    def read(self) -> LockHolder | None:
        try:
            text = retry_transient(self.path.read_text)
        except FileNotFoundError:
            return None
        try:
            data = json.loads(text)
            return LockHolder(**{k: data[k] for k in LockHolder.__dataclass_fields__})
        except (ValueError, KeyError, TypeError):
            # Written by something else: no heartbeat to trust; its mtime stands in for one.
            try:
                mtime = self.path.stat().st_mtime
            except FileNotFoundError:
                return None
            return LockHolder(UNREADABLE, UNREADABLE, "job", UNREADABLE, 0, mtime, mtime)

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
            live = liveness(holder, is_active=is_active)
            if live.alive:
                raise RunLockedError(
                    f"this run is active: {holder.describe()} ({live.why})",
                    where=str(self.paths.root),
                    hint=f"stop it first (hpclaunch stop {self.paths.root}), or wait until it ends",
                )
            if self.take_over(holder, mine):
                return mine
        raise RunLockedError("could not take the run-directory lock (contended)", where=str(self.path))

    def take_over(self, stale: LockHolder, mine: LockHolder) -> bool:
        """Replace the ``stale`` holder by ``mine``; False when another contender won (or the lock
        changed meanwhile). Only the contender that creates the takeover marker may replace it."""
        marker = self.path.with_name(f"{self.path.name}.takeover-{stale.fingerprint()}")
        if not create_exclusive(marker, json.dumps(asdict(mine))):
            with contextlib.suppress(FileNotFoundError):  # a contender that died mid-takeover
                if time.time() - marker.stat().st_mtime > STALE_AFTER_S:
                    marker.unlink()
            return False
        try:
            with self._exclusive():
                current = self.read()
                if current is not None and current.fingerprint() != stale.fingerprint():
                    return False  # not the holder we judged stale any more
                self.set(mine)
                return True
        finally:
            marker.unlink(missing_ok=True)

    def set(self, holder: LockHolder) -> None:
        """Replace the holder (the job's own agent adopting its lock, or handing it on)."""
        atomic_write_text(self.path, json.dumps(asdict(holder), indent=2) + "\n")

    def adopt(self, *, job_id: str, role: str) -> LockHolder:
        """The job's running process takes over the lock its submission made (same job id)."""
        with self._exclusive():
            now = time.time()
            holder = self.read()
            acquired = holder.acquired if holder is not None else now
            scheduler = holder.scheduler if holder is not None else "?"
            mine = LockHolder(job_id, scheduler, role, _this_host(), os.getpid(), acquired, now)
            self.set(mine)
            return mine

    def heartbeat(self, holder: LockHolder) -> bool:
        """Refresh ``holder``'s heartbeat; False when the lock is no longer ours."""
        with self._exclusive():  # a hand-over or release between this read and the write wins
            current = self.read()
            if current is None or (current.job_id, current.pid, current.host) != (
                holder.job_id,
                holder.pid,
                holder.host,
            ):
                return False
            self.set(replace(current, heartbeat=time.time()))
            return True

    def hand_over(self, holder: LockHolder, job_id: str) -> bool:
        """The lock now belongs to the job ``job_id`` (a continuation or a requeue) waiting in the
        queue; False when it is not ``holder``'s any more (that job started already and adopted it:
        a released continuation can start before this attempt has finished handing over)."""
        with self._exclusive():
            current = self.read()
            if current is not None and (current.job_id, current.pid, current.host) != (
                holder.job_id,
                holder.pid,
                holder.host,
            ):
                return False
            now = time.time()
            self.set(replace(holder, job_id=job_id, role="job", pid=0, heartbeat=now))
            return True

    def release(self, holder: LockHolder | None = None) -> None:
        """Remove the lock (only if ``holder`` still holds it, when given)."""
        with self._exclusive():
            current = self.read()
            if current is None:
                return
            if holder is not None and (current.job_id, current.pid) != (holder.job_id, holder.pid):
                return
            aside = self.path.with_name(f".lock.released-{unique_suffix()}")
            with contextlib.suppress(FileNotFoundError):
                os.rename(self.path, aside)
                aside.unlink(missing_ok=True)

    # ---- internals ----------------------------------------------------------------------------

    def _create(self, holder: LockHolder) -> bool:
        return create_exclusive(self.path, json.dumps(asdict(holder), indent=2) + "\n")

    @property
    def _mutex(self) -> Path:
        return self.path.with_name(f"{self.path.name}.writing")

    @contextlib.contextmanager
    def _exclusive(self) -> Iterator[None]:
        """Hold the update mutex (see the module docstring); TimeoutError (an OSError, which the
        heartbeat thread takes as a hiccup) when a live holder keeps it past MUTEX_GIVE_UP_S."""
        token = json.dumps({"host": _this_host(), "pid": os.getpid(), "nonce": uuid.uuid4().hex})
        start = seen_since = time.monotonic()
        seen: str | None = None
        while not create_exclusive(self._mutex, token):
            current, now = self._mutex_token(), time.monotonic()
            if current != seen:
                seen, seen_since = current, now
            elif current is not None and (now - seen_since > MUTEX_STALE_S or _holder_gone_here(current)):
                self._break_mutex(current)
                continue
            if now - start > MUTEX_GIVE_UP_S:
                raise TimeoutError(f"{self._mutex} held by {current} for {now - seen_since:.0f} s")
            time.sleep(MUTEX_POLL_S)
        try:
            yield
        finally:
            # Ours unless a waiter broke it while we stalled past MUTEX_STALE_S: leave a new one be.
            if self._mutex_token() == token:
                self._mutex.unlink(missing_ok=True)

    def _mutex_token(self) -> str | None:
        try:
            return self._mutex.read_text()
        except FileNotFoundError:
            return None

    def _break_mutex(self, dead: str) -> None:
        """Remove the mutex holding ``dead``: renamed aside first (one breaker wins), and put back
        when what was moved is a fresh one after all (another breaker and a new holder were quicker)."""
        aside = self.path.with_name(f".{self._mutex.name}.broken-{unique_suffix()}")
        try:
            os.rename(self._mutex, aside)
        except FileNotFoundError:
            return
        try:
            if aside.read_text() != dead:
                with contextlib.suppress(FileExistsError):
                    os.link(aside, self._mutex)
        finally:
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
