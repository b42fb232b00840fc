"""Moving shards: a snapshot's background job (own copy, buddy copy), and a restore's pulls.

A snapshot travels on a gloo group of its own (``new_link``, connected lazily: a rank holds sockets
to its buddy and its ward only), so that its traffic never queues behind, or in front of, the
training's collectives; a restore's pulls (at start-up, before any training) on the host group. A
snapshot's job runs in a thread of the rank (``JobThread``): the copies run in the kernel
(``sendfile``), zlib's checksum and gloo's transport, all without the GIL, so the training loop only
pays for the staging copy. Every rank starts a job at the same steps (a rank whose previous job is
still running waits for it, up to a deadline: nothing is skipped, so every send has its receive).

The job, for snapshot ``s`` on rank ``r`` with buddy ``b`` and ward ``w``:
1. reserves room for ``r``'s payload in its node's store and writes it there (temporary names), with
   its checksum in the description;
2. tells ``b`` whether it has a shard, and its sizes, and hears ``w``'s;
3. reserves room for ``w``'s copy and tells ``w`` whether it may send (a full tmpfs says no here,
   before a byte is sent: nothing is received into memory that is not there), and hears ``b``'s word;
4. sends ``r``'s description and payload to ``b`` if ``b`` said yes, while receiving ``w``'s;
5. publishes ``w``'s copy, then its own: a rank killed before its send completed never publishes
   its own shard, so a snapshot interrupted half-way is never whole anywhere.

Everything that can fail on this rank fails before step 2 or is said in step 3, so a peer is never
left waiting for a message this rank will not send. The link's gloo timeout (the tier's
``wait_s``) ends a wait on a peer that died or is stuck; after a transport error gloo's link is
unusable, so the job says ``link_broken`` and the tier steps aside for the rest of the attempt.
Operating-system and transport errors are a failed snapshot (the disk tier is still there);
anything else is a bug, re-raised in the training loop.
"""

from __future__ import annotations

import datetime
import os
import queue
import re
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ...rundir.shm import TierPlaceError
from ..checkpoint.fault_hooks import kill_hook, snapshot_copy_delay_hook
from ..checkpoint.staging import Staged
from .buddies import Pull
from .store import HeldShard, NodeStore, PendingShard

# What a snapshot may fail of, as opposed to a bug: the disk tier then serves.
FAILURES = (OSError, RuntimeError, TierPlaceError)


@dataclass(frozen=True)
class Link:
    """This rank's buddy and ward (None on one node), and the gloo group it reaches them on."""

    buddy: int | None
    ward: int | None
    group: Any = None
    timeout_s: float = 1800.0  # what one wait on a peer may last (gloo's timeout on the group)


LAZY_GLOO = "TORCH_GLOO_LAZY_INIT"


def new_link(buddy: int | None, ward: int | None, timeout_s: float = 1800.0) -> Link:
    """Collective over every rank: the snapshots' own gloo group, connected lazily (gloo connects a
    pair of ranks at their first message). A rank only ever talks to its buddy and its ward there,
    so it holds their two sockets, not a mesh of the world: measured at 4 ranks, a lazy group holds
    4 descriptors + 1 per peer used, an eager one W + 3, which at 4,096 ranks is 4,099 per rank.
    (Groups of two made only by their members, ``use_local_synchronization``, were tried: ranks
    making different pairs at once waited for each other for ever.) ``timeout_s``: what one wait on
    a peer may last (gloo raises then; the group's default is 30 minutes)."""
    if buddy is None or ward is None or not (dist.is_available() and dist.is_initialized()):
        return Link(buddy, ward)
    before = os.environ.get(LAZY_GLOO)
    os.environ[LAZY_GLOO] = "1"  # (read when a group is made: only this one is lazy)
    try:
        group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
    finally:
        if before is None:
            del os.environ[LAZY_GLOO]
        else:
            os.environ[LAZY_GLOO] = before
    return Link(buddy, ward, group, timeout_s)


def _bytes_tensor(buf: Any) -> torch.Tensor:
    return torch.frombuffer(buf, dtype=torch.uint8) if len(buf) else torch.empty(0, dtype=torch.uint8)


def checksum(buf: Any) -> int:
    """A shard's payload checksum (zlib's CRC-32, 3.7 GB/s here, without the GIL): it finds a torn
    or damaged shard; the private root keeps out a planted one."""
    return zlib.crc32(buf)


@dataclass(frozen=True)
class SnapshotPlace:
    """Where one rank's snapshots go, the same for every snapshot of an attempt: its node's store
    (None: the tier has no place on the node; the rank still trades with its buddy and ward), its
    rank in a world of ``world``, its link to its buddy and ward, and how many the store keeps."""

    store: NodeStore | None
    world: int
    rank: int
    link: Link
    keep_last: int


class SnapshotJob:
    """One snapshot's background work (see the module docstring); ``error`` when it failed, ``crash``
    when a bug ended it (re-raised by the training loop)."""

    def __init__(
        self,
        place: SnapshotPlace,
        *,
        staged: Staged | None,
        finish: Callable[[], None] | None,
        describe: Callable[[Staged, int], bytes],
        step: int,
        error: str | None = None,
    ) -> None:
        self.staged, self.finish, self.describe, self.step = staged, finish, describe, step
        self.nbytes = staged.layout.nbytes if staged is not None else 0
        self.meta = b""
        self.store, self.world, self.rank = place.store, place.world, place.rank
        self.link, self.keep_last = place.link, place.keep_last
        self.error = error  # (given: staging failed in the training loop; the job still trades sizes)
        self.crash: BaseException | None = None
        self.link_broken = False  # a transport error: the link is unusable for the rest of the attempt
        self.replica_kept: bool | None = None  # the buddy kept this rank's copy (None: no buddy)
        self.seconds: float | None = None
        self.submitted = time.monotonic()
        self._finished = threading.Event()

    def done(self) -> bool:
        return self._finished.is_set()

    def join(self, timeout: float | None = None) -> bool:
        return self._finished.wait(timeout)

    def run(self) -> None:
        try:
            self._run()
        except Exception as e:  # a bug: the training loop re-raises it (``MemoryTier``)
            self.crash = e
        finally:
            if self.staged is not None:
                self.staged.copied.set()  # (never leave the optimizer waiting)
            self._finished.set()

    def _run(self) -> None:
        begun = time.perf_counter()
        own = self._write_own()
        kill_hook(self.step, self.rank, "write")
        try:
            if self.link.buddy is not None:  # (always: the buddy and the ward wait for this rank)
                try:
                    self._exchange(own)
                except RuntimeError as e:  # gloo's: a peer gone, stuck past the timeout, a reset
                    self.link_broken = True
                    self.error = self._transport_words(e)
                    raise
            if own is not None:
                own.publish(self.meta)
                own = None
            if self.store is not None:
                ward = {self.link.ward} if self.link.ward is not None else set()
                self.store.prune(sorted({self.rank, *ward}), self.keep_last, self.step)
        except FAILURES as e:  # (a peer that died, a tmpfs gone: the disk tier is still there)
            if not self.link_broken:
                self.error = self.error or f"snapshot of step {self.step}: {type(e).__name__}: {e}"
        finally:
            if own is not None:
                own.drop()
        self.seconds = time.perf_counter() - begun

    def _write_own(self) -> PendingShard | None:
        """Step 1: the staging copies (CPU), the checksum and description, this rank's payload in
        its node's store (unpublished); None, with ``error`` said, when any of it failed."""
        if self.staged is None or self.finish is None:
            return None  # (staging failed in the training loop: ``error`` says so)
        try:
            snapshot_copy_delay_hook()
            self.finish()  # the staging copy, which the optimizer's next update waits for
        except FAILURES as e:
            self.error = f"staging the snapshot of step {self.step}: {type(e).__name__}: {e}"
            return None
        finally:
            self.staged.copied.set()
        if self.store is None:
            return None  # (the tier has no place on this node: said when the tier began)
        own: PendingShard | None = None
        try:
            self.staged.wait()  # (CUDA: the copies into the staging buffer)
            self.meta = self.describe(self.staged, checksum(self.staged.layout.view()))
            own = self.store.begin(self.step, self.world, self.rank, self.nbytes)
            own.copy_from_fd(self.staged.layout.fd)
            return own
        except FAILURES as e:
            self.error = f"writing the snapshot of step {self.step}: {e}"
            if own is not None:
                own.drop()
            return None

    def _exchange(self, own: PendingShard | None) -> None:
        """Steps 2 to 4, with the buddy and the ward at once."""
        link, tag = self.link, (self.step % 100_000) * 4
        assert link.buddy is not None and link.ward is not None
        mine = torch.tensor([own is not None, len(self.meta), self.nbytes], dtype=torch.int64)
        theirs = torch.zeros(3, dtype=torch.int64)
        _wait(
            [
                dist.isend(mine, link.buddy, group=link.group, tag=tag),
                dist.irecv(theirs, link.ward, group=link.group, tag=tag),
            ]
        )
        kill_hook(self.step, self.rank, "send")
        replica = self._room_for_ward(int(theirs[2])) if int(theirs[0]) else None
        yes, kept = torch.tensor([replica is not None], dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
        _wait(
            [
                dist.isend(yes, link.ward, group=link.group, tag=tag + 1),
                dist.irecv(kept, link.buddy, group=link.group, tag=tag + 1),
            ]
        )
        self.replica_kept = own is not None and bool(kept[0])
        works, meta_in, received, sent = [], None, None, []
        if own is not None and self.replica_kept:
            sent = [_bytes_tensor(bytearray(self.meta)), _bytes_tensor(own.payload())]
            works += [
                dist.isend(t, link.buddy, group=link.group, tag=tag + 2 + i) for i, t in enumerate(sent)
            ]
        if replica is not None:
            meta_in = torch.empty(int(theirs[1]), dtype=torch.uint8)
            received = _bytes_tensor(replica.payload())
            works += [
                dist.irecv(meta_in, link.ward, group=link.group, tag=tag + 2),
                dist.irecv(received, link.ward, group=link.group, tag=tag + 3),
            ]
        try:
            _wait(works)
            del works, sent, received  # (the views into the mapped files, before they are closed)
            if replica is not None and meta_in is not None:
                replica.publish(meta_in.numpy().tobytes())
                replica = None
        finally:
            if replica is not None:
                replica.drop()

    def _transport_words(self, e: RuntimeError) -> str:
        """Gloo's error in the user's words: which peers, and what happened (its file and line and
        its boilerplate left out)."""
        text = re.sub(r"^\[[^\]]*\]\s*", "", str(e).split("\n")[0])
        text = text.split(". This is typically")[0]
        peers = f"its buddy (rank {self.link.buddy}) or its ward (rank {self.link.ward})"
        if "Timed out" in text:
            return (
                f"the snapshot of step {self.step}: {peers} did not answer within {self.link.timeout_s:g} s "
                "(checkpoint.memory.wait_s): gone or stuck"
            )
        return f"the snapshot of step {self.step}: the link to {peers} broke ({text})"

    def _room_for_ward(self, nbytes: int) -> PendingShard | None:
        """Step 3: the ward's copy, its room reserved; None (said) when there is none."""
        assert self.link.ward is not None
        if self.store is None:
            return None
        try:
            return self.store.begin(self.step, self.world, self.link.ward, nbytes)
        except FAILURES as e:
            self.error = self.error or f"keeping rank {self.link.ward}'s snapshot of step {self.step}: {e}"
            return None


class JobThread:
    """The one thread that runs a rank's snapshot jobs, one at a time, started with the tier: handing
    a job to a thread that waits costs the training loop nothing, where starting a thread makes it
    wait for the new thread to take the GIL (up to the 5 ms switch interval)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[SnapshotJob | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name="snapshots", daemon=True)
        self._thread.start()

    def submit(self, job: SnapshotJob) -> SnapshotJob:
        self._jobs.put(job)
        return job

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            job.run()

    def close(self) -> None:
        self._jobs.put(None)


def _wait(works: list[Any]) -> None:
    for w in works:
        w.wait()


def open_sends(
    pulls: tuple[Pull, ...], store: NodeStore, step: int, world: int, rank: int
) -> list[HeldShard]:
    """The shards this rank sends in a restore, opened (mapped: sending them copies nothing); raises
    ``FAILURES`` when one cannot be (every rank hears of it before anything is sent)."""
    opened: list[HeldShard] = []
    try:
        for p in pulls:
            if p.sender == rank:
                held = store.open(step, world, p.shard)
                opened.append(held)
                if len(held.payload()) != p.nbytes or len(held.meta) != p.meta_bytes:
                    raise OSError(f"rank {p.shard}'s shard of step {step} changed size since it was listed")
    except BaseException:
        for h in opened:
            h.close()
        raise
    return opened


def exchange_pulls(
    pulls: tuple[Pull, ...], sends: list[HeldShard], rank: int, group: Any
) -> tuple[bytes, torch.Tensor] | None:
    """Collective over the ranks a pull names, on ``group`` (the host group: a pull's sender is the
    first rank of a node that holds the shard, not always a buddy): send the shards this rank's node
    serves to others (``sends``, from ``open_sends``, in the same order), and receive this rank's
    own when it is pulled; (description, payload), or None. The memory this costs is bounded: a
    sender sends from the tmpfs's own pages, a receiver holds its one shard."""
    tag = 1_000_000
    works: list[Any] = []
    keep: list[torch.Tensor] = []
    mine: tuple[torch.Tensor, torch.Tensor] | None = None
    ours = iter(sends)
    for p in pulls:
        if p.sender == rank:
            held = next(ours)
            ts = [_bytes_tensor(bytearray(held.meta)), _read_only_tensor(held.payload())]
            keep += ts
            works += [
                dist.isend(t, p.receiver, group=group, tag=tag + 2 * p.shard + i) for i, t in enumerate(ts)
            ]
        if p.receiver == rank:
            mine = (torch.empty(p.meta_bytes, dtype=torch.uint8), torch.empty(p.nbytes, dtype=torch.uint8))
            works += [
                dist.irecv(t, p.sender, group=group, tag=tag + 2 * p.shard + i) for i, t in enumerate(mine)
            ]
    _wait(works)
    del keep
    if mine is None:
        return None
    return mine[0].numpy().tobytes(), mine[1]


def _read_only_tensor(buf: memoryview) -> torch.Tensor:
    """A tensor over a read-only mapping, only ever sent from (torch warns that it is not writable)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return _bytes_tensor(buf)
