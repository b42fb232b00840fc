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

Authority is fenced by an epoch. Every change of holder (a first acquisition, a takeover of a
stale holder, a job's adoption of the lock its submission made, an agent taking the decider's role
over, a hand-over to the job that continues the run, a release) claims the next epoch: it creates
``lock.epochs/<N+1>`` (holding the new holder's record) by ``link()`` of a fully written temporary
file, which is atomic and exclusive on every shared filesystem we meet, NFS included (O_EXCL was
not always). Of two contenders moving from epoch N, one creates ``<N+1>``; the other fails and
reads again. The holder carries its epoch, so a holder that was deposed while it stalled (a GC
pause, a hung NFS client, SIGSTOP) finds its next hand-over or release refused, and its callers
ask ``holds`` before they write what only the holder may write (``jobs.decider_role``: the start's
go, the decision, its record). ``lock.json`` is the current holder's view with its heartbeat;
a reader follows the epoch files past it (one ``stat`` of the next one), so a late write of an old
view (a heartbeat that stalled past a claim) cannot bring a deposed holder back.

Every rewrite of ``lock.json`` (heartbeat, the view after a claim, a release's removal) runs while
holding ``lock.json.writing``, a mutex created the same way (``link()``), so a heartbeat that read
"mine" does not write that back over a hand-over or a release made since. Not ``flock``: over NFS
it depends on lockd (and on Lustre on a mount option), and a lock lost with a client goes
unnoticed. A mutex whose holder died inside its few milliseconds is broken by a waiter that saw the
same token in it for ``MUTEX_STALE_S`` on its own monotonic clock (or whose holder's pid is gone on
this host): breaking it can at worst let a stalled holder's late rewrite land on ``lock.json``, and
the epochs (never the mutex) say who holds the run.
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
from ..fsutil import atomic_write_text, create_exclusive, retry_transient, take_aside, unique_suffix
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
    epoch: int = 0  # the fencing token: which claim of the lock this holder made (0: before epochs)
    # The holder process's start (``/proc/<pid>/stat`` field 22, clock ticks since boot; 0: not
    # known): a pid is the holder's only while it names the same process (pids are reused).
    pid_start: int = 0

    def describe(self, now: float | None = None) -> str:
        age = (now or time.time()) - self.heartbeat
        if self.job_id == UNREADABLE:
            return f"an unreadable lock file (last written {age:.0f} s ago)"
        who = "foreground train" if self.role == "train" else f"{self.scheduler} job {self.job_id}"
        where = f"{self.role} pid {self.pid} on {self.host}" if self.role in PROCESS_ROLES else "queued"
        return f"{who} ({where}, heartbeat {age:.0f} s ago)"

    def same(self, other: LockHolder | None) -> bool:
        """``other`` is this very holder (its heartbeat aside): the same process, the same claim."""
        return other is not None and (self.job_id, self.pid, self.host, self.epoch) == (
            other.job_id,
            other.pid,
            other.host,
            other.epoch,
        )

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


def _stat_fields(pid: int) -> list[str] | None:
    """``/proc/<pid>/stat`` after the command's name (state first), or None: no such process."""
    if pid <= 0:
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1].split()
    except (FileNotFoundError, IndexError, PermissionError, ProcessLookupError):
        return None


def process_start(pid: int) -> int:
    """When process ``pid`` started (clock ticks since boot), 0 when there is no such process."""
    fields = _stat_fields(pid)
    return int(fields[19]) if fields is not None and len(fields) > 19 else 0


def _pid_alive(pid: int, start: int = 0) -> bool:
    """Process ``pid`` runs (not a zombie) and, when ``start`` is known, is the one that started
    then: after its death the same pid may name another process."""
    fields = _stat_fields(pid)
    if fields is None or fields[0] == "Z":
        return False
    return not start or (len(fields) > 19 and int(fields[19]) == start)


def _own_start() -> int:
    return process_start(os.getpid())


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
        alive = _pid_alive(holder.pid, holder.pid_start)
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


_FIELDS = ("job_id", "scheduler", "role", "host", "pid", "acquired", "heartbeat")


def _holder_of(data: object) -> LockHolder | None:
    """A lock record as written (``epoch`` missing in a lock from before epochs: 0); None when it
    is not one (a release's record, or something else)."""
    if not isinstance(data, dict) or data.get("released"):
        return None
    return LockHolder(
        **{k: data[k] for k in _FIELDS},
        epoch=int(data.get("epoch") or 0),
        pid_start=int(data.get("pid_start") or 0),
    )


class RunLock:
    def __init__(self, paths: RunPaths):
        self.paths = paths
        self.path = paths.lock
        self.epochs = self.path.with_name("lock.epochs")

    def read(self) -> LockHolder | None:
        """The current holder (None: nobody holds the run)."""
        return self.state()[1]

    def state(self) -> tuple[int, LockHolder | None]:
        """The current epoch and its holder: ``lock.json``, unless a later epoch was claimed (then
        that claim's record; a release's is None). One read and one ``stat`` while ``lock.json``
        is there; a listing of the epochs where it is not."""
        cached = self._read_view()
        holder: LockHolder | None = cached
        if cached is not None:
            epoch = cached.epoch
        else:
            epoch = self._top_epoch()
            holder = self._claimed(epoch)[1] if epoch > 0 else None
        while True:
            later, claimed = self._claimed(epoch + 1)
            if not later:
                return epoch, holder
            epoch, holder = epoch + 1, claimed

    def holds(self, holder: LockHolder) -> bool:
        """``holder`` is still the run's holder: no later epoch was claimed (the fence a holder
        checks before it writes what only the holder may write)."""
        return holder.same(self.read())

    def acquire(self, *, job_id: str, scheduler: str, role: str, is_active: ActiveCheck | None) -> LockHolder:
        """Take the lock or raise RunLockedError naming the live holder."""
        now = time.time()
        mine = LockHolder(
            job_id, scheduler, role, _this_host(), os.getpid(), now, now, pid_start=_own_start()
        )
        for _ in range(5):
            epoch, holder = self.state()
            if holder is None:
                claimed = self._claim(epoch, mine)
                if claimed is not None:
                    return claimed
                continue  # another contender claimed it meanwhile: read again
            live = liveness(holder, is_active=is_active)
            if live.alive:
                raise RunLockedError(
                    f"this run is active: {holder.describe()} ({live.why})",
                    where=str(self.paths.root),
                    hint=f"stop it first (hpclaunch stop {self.paths.root}), or wait until it ends",
                )
            claimed = self._take(holder, mine)
            if claimed is not None:
                return claimed
        raise RunLockedError("could not take the run-directory lock (contended)", where=str(self.path))

    def take_over(self, stale: LockHolder, mine: LockHolder) -> bool:
        """Replace the ``stale`` holder by ``mine``; False when another contender won (or the lock
        changed meanwhile)."""
        return self._take(stale, mine) is not None

    def _take(self, stale: LockHolder, mine: LockHolder) -> LockHolder | None:
        # (a holder judged stale that beat since is not taken: its fingerprint changed)
        epoch, current = self.state()
        if current is None or current.fingerprint() != stale.fingerprint():
            return None
        return self._claim(epoch, mine)

    def set(self, holder: LockHolder) -> None:
        """Write ``holder`` as the lock's view (its heartbeat, the job id a submission learned);
        who holds the run is the epochs' to say, not this file's."""
        atomic_write_text(self.path, json.dumps(asdict(holder), indent=2) + "\n")

    def adopt(self, *, job_id: str, role: str) -> LockHolder:
        """The job's running process takes over the lock its submission made (same job id): the
        next epoch is claimed whoever holds it now (the caller has judged that holder)."""
        for _ in range(5):
            epoch, holder = self.state()
            now = time.time()
            acquired = holder.acquired if holder is not None else now
            scheduler = holder.scheduler if holder is not None else "?"
            mine = LockHolder(
                job_id, scheduler, role, _this_host(), os.getpid(), acquired, now, pid_start=_own_start()
            )
            claimed = self._claim(epoch, mine)
            if claimed is not None:
                return claimed
        raise RunLockedError("could not adopt the run-directory lock (contended)", where=str(self.path))

    def take_role(self, *, job_id: str) -> LockHolder | None:
        """An agent of job ``job_id`` takes the decider's role over: it claims the next epoch while
        the lock is still its own job's (None when another job holds the run now, or another agent
        of this job claimed it first: then that one decides)."""
        epoch, holder = self.state()
        if holder is None or holder.job_id != job_id:
            return None
        now = time.time()
        mine = LockHolder(
            job_id,
            holder.scheduler,
            "agent",
            _this_host(),
            os.getpid(),
            holder.acquired,
            now,
            pid_start=_own_start(),
        )
        return self._claim(epoch, mine)

    def heartbeat(self, holder: LockHolder) -> bool:
        """Refresh ``holder``'s heartbeat; False when the lock is no longer ours."""
        with self._exclusive():  # a hand-over or release between this read and the write wins
            current = self.read()
            if not holder.same(current):
                return False
            assert current is not None
            self.set(replace(current, heartbeat=time.time()))
            return True

    def hand_over(self, holder: LockHolder, job_id: str) -> bool:
        """The lock now belongs to the job ``job_id`` (a continuation or a requeue) waiting in the
        queue; False when it is not ``holder``'s any more (that job started already and adopted it:
        a released continuation can start before this attempt has finished handing over; or
        ``holder`` was deposed while it stalled)."""
        epoch, current = self.state()
        if not holder.same(current):
            return False
        queued = replace(holder, job_id=job_id, role="job", pid=0, pid_start=0, heartbeat=time.time())
        return self._claim(epoch, queued) is not None

    def release(self, holder: LockHolder | None = None) -> None:
        """Remove the lock (only if ``holder`` still holds it, when given)."""
        epoch, current = self.state()
        if current is None or (holder is not None and not holder.same(current)):
            return
        if not create_exclusive(
            self._epoch_file(epoch + 1), json.dumps({"released": True, "epoch": epoch + 1})
        ):
            return  # another claim came first: not ours to remove
        with self._exclusive():
            view = self._read_view()
            if view is not None and view.epoch > epoch + 1:
                return  # claimed again since (a new submission): its view stays
            aside = self.path.with_name(f".lock.released-{unique_suffix()}")
            if take_aside(self.path, aside):
                aside.unlink(missing_ok=True)

    # ---- internals ----------------------------------------------------------------------------

    def _claim(self, epoch: int, holder: LockHolder) -> LockHolder | None:
        """``holder`` takes epoch ``epoch + 1`` if nobody else has (exclusive); then its view is
        written. None when another claim came first."""
        mine = replace(holder, epoch=epoch + 1)
        if not create_exclusive(self._epoch_file(mine.epoch), json.dumps(asdict(mine)) + "\n"):
            return None
        try:
            with self._exclusive():
                self.set(mine)
        except TimeoutError:
            self.set(mine)  # the claim stands whatever the view says; readers follow the epochs
        return mine

    def _epoch_file(self, epoch: int) -> Path:
        return self.epochs / str(epoch)

    def _claimed(self, epoch: int) -> tuple[bool, LockHolder | None]:
        """Whether anyone claimed ``epoch``, and its holder (None: a release)."""
        try:
            text = retry_transient(self._epoch_file(epoch).read_text)
        except FileNotFoundError:
            return False, None
        try:
            return True, _holder_of(json.loads(text))
        except (ValueError, KeyError, TypeError):
            return True, None  # (written whole by link(): only damage makes it unreadable)

    def _top_epoch(self) -> int:
        try:
            names = retry_transient(lambda: os.listdir(self.epochs))
        except FileNotFoundError:
            return 0
        return max((int(n) for n in names if n.isdigit()), default=0)

    def _read_view(self) -> LockHolder | None:
        """``lock.json`` as written (None when absent); one that cannot be parsed has no heartbeat
        to trust: its modification time stands in for one."""
        try:
            text = retry_transient(self.path.read_text)
        except FileNotFoundError:
            return None
        try:
            return _holder_of(json.loads(text))
        except (ValueError, KeyError, TypeError):
            pass
        try:
            mtime = self.path.stat().st_mtime
        except FileNotFoundError:
            return None
        return LockHolder(UNREADABLE, UNREADABLE, "job", UNREADABLE, 0, mtime, mtime)

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
        if not take_aside(self._mutex, aside):
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
