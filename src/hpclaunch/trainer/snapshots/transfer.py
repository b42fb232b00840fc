"""Moving shards: a snapshot's background job (own copy, buddy copy), and a restore's pulls.

A snapshot travels on a gloo group of its own (``new_link``, connected lazily: a rank holds sockets
to its buddy and its ward only), so that its traffic never queues behind, or in front of, the training's collectives; a
restore's pulls (at start-up, before any training) on the host group. A snapshot's job runs in a thread of the rank (``JobThread``):
the copies run in the kernel (``sendfile``) and in gloo's transport, both without the GIL, so the
training loop only pays for the staging copy. Every rank starts a job at the same steps (a rank whose
previous job is still running waits for it: nothing is skipped, so every send has its receive).

The job, for snapshot ``s`` on rank ``r`` with buddy ``b`` and ward ``w``:
1. writes ``r``'s payload into its node's store (temporary names);
2. tells ``b`` its sizes and hears ``w``'s (a shard that could not be written is said, not sent);
3. sends ``r``'s description and payload to ``b`` while receiving ``w``'s into the store;
4. publishes ``w``'s copy, then its own: a rank killed before its send completed never publishes its
   own shard, so a snapshot interrupted half-way is never whole anywhere.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..checkpoint.faults import kill_hook
from ..checkpoint.staging import Staged
from .plan import Pull
from .store import NodeStore, PendingShard


@dataclass(frozen=True)
class Link:
    """This rank's buddy and ward (None on one node), and the gloo group it reaches them on."""

    buddy: int | None
    ward: int | None
    group: Any = None


LAZY_GLOO = "TORCH_GLOO_LAZY_INIT"


def new_link(buddy: int | None, ward: int | None) -> Link:
    """Collective over every rank: the snapshots' own gloo group, connected lazily (gloo connects a
    pair of ranks at their first message). A rank only ever talks to its buddy and its ward there,
    so it holds their two sockets, not a mesh of the world: measured at 4 ranks, a lazy group holds
    4 descriptors + 1 per peer used, an eager one W + 3, which at 4,096 ranks is 4,099 per rank.
    (Groups of two made only by their members, ``use_local_synchronization``, were tried: ranks
    making different pairs at once waited for each other for ever.)"""
    if buddy is None or ward is None or not (dist.is_available() and dist.is_initialized()):
        return Link(buddy, ward)
    before = os.environ.get(LAZY_GLOO)
    os.environ[LAZY_GLOO] = "1"  # (read when a group is made: only this one is lazy)
    try:
        group = dist.new_group(backend="gloo")
    finally:
        if before is None:
            del os.environ[LAZY_GLOO]
        else:
            os.environ[LAZY_GLOO] = before
    return Link(buddy, ward, group)


def _bytes_tensor(buf: Any) -> torch.Tensor:
    return torch.frombuffer(buf, dtype=torch.uint8) if len(buf) else torch.empty(0, dtype=torch.uint8)


class SnapshotJob:
    """One snapshot's background work (see the module docstring); ``error`` when it failed."""

    def __init__(
        self,
        store: NodeStore,
        *,
        staged: Staged | None,
        finish: Callable[[], None] | None,
        describe: Callable[[Staged], bytes],
        step: int,
        world: int,
        rank: int,
        link: Link,
        keep_last: int,
        error: str | None = None,
    ) -> None:
        self.store, self.staged, self.finish, self.describe = store, staged, finish, describe
        self.nbytes = staged.layout.nbytes if staged is not None else 0
        self.meta = b""
        self.step, self.world, self.rank, self.link, self.keep_last = step, world, rank, link, keep_last
        self.error = error  # (given: staging failed in the training loop; the job still trades sizes)
        self.seconds: float | None = None
        self._finished = threading.Event()

    def done(self) -> bool:
        return self._finished.is_set()

    def join(self, timeout: float | None = None) -> bool:
        return self._finished.wait(timeout)

    def run(self) -> None:
        try:
            self._run()
        finally:
            self._finished.set()

    def _run(self) -> None:
        begun = time.perf_counter()
        own = self._write_own()
        kill_hook(self.step, self.rank, "write")
        try:
            if self.link.buddy is not None:  # (always: the buddy and the ward wait for this rank)
                self._exchange(own)
            if own is not None:
                own.publish(self.meta)
                own = None
            self.store.prune(sorted({self.rank, self.link.ward or self.rank}), self.keep_last)
        except Exception as e:  # (a peer that died, a full tmpfs: the disk tier is still there)
            self.error = self.error or f"snapshot of step {self.step}: {type(e).__name__}: {e}"
        finally:
            if own is not None:
                own.drop()
        self.seconds = time.perf_counter() - begun

    def _write_own(self) -> PendingShard | None:
        """Step 1: the staging copies (CPU), the description, this rank's payload in its node's
        store (unpublished); None, with ``error`` said, when any of it failed."""
        if self.staged is None or self.finish is None:
            return None  # (staging failed in the training loop: ``error`` says so)
        try:
            self.finish()  # the staging copy, which the optimizer's next update waits for
        except Exception as e:
            self.error = f"staging the snapshot of step {self.step}: {type(e).__name__}: {e}"
            return None
        finally:
            self.staged.copied.set()  # (never leave the optimizer waiting)
        own: PendingShard | None = None
        try:
            self.meta = self.describe(self.staged)
            self.staged.wait()  # (CUDA: the copies into the staging buffer)
            own = self.store.begin(self.step, self.world, self.rank, self.nbytes)
            own.copy_from_fd(self.staged.layout.fd)
            return own
        except Exception as e:
            self.error = f"writing the snapshot of step {self.step} into {self.store.directory}: {e}"
            if own is not None:
                own.drop()
            return None

    def _exchange(self, own: PendingShard | None) -> None:
        """Steps 2 and 3: sizes, then the shards, with the buddy and the ward at once."""
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
        sent, meta_in, received, replica = [], None, None, None
        if own is not None:
            sent = [_bytes_tensor(bytearray(self.meta)), _bytes_tensor(own.payload())]
        works = [dist.isend(t, link.buddy, group=link.group, tag=tag + 1 + i) for i, t in enumerate(sent)]
        if int(theirs[0]):
            nbytes = int(theirs[2])
            try:
                replica = self.store.begin(self.step, self.world, link.ward, nbytes)
                received = _bytes_tensor(replica.payload())
            except OSError as e:  # received all the same (the ward's send must complete), then dropped
                self.error = f"keeping rank {link.ward}'s snapshot of step {self.step}: {e}"
                replica, received = None, torch.empty(nbytes, dtype=torch.uint8)
            meta_in = torch.empty(int(theirs[1]), dtype=torch.uint8)
            works += [
                dist.irecv(meta_in, link.ward, group=link.group, tag=tag + 1),
                dist.irecv(received, link.ward, group=link.group, tag=tag + 2),
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


def exchange_pulls(
    pulls: tuple[Pull, ...], store: NodeStore, step: int, world: int, rank: int, group: Any
) -> tuple[bytes, bytes] | None:
    """Collective over the ranks a pull names, on ``group`` (the host group: a pull's sender is the
    first rank of a node that holds the shard, not always a buddy): send the shards this rank's node
    serves to others, and receive this rank's own when it is pulled; (description, payload), or None."""
    tag = 1_000_000
    works, keep = [], []
    mine: tuple[torch.Tensor, torch.Tensor] | None = None
    for p in pulls:
        if p.sender == rank:
            meta, payload = store.read(step, world, p.shard)
            ts = [_bytes_tensor(bytearray(meta)), _bytes_tensor(bytearray(payload))]
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
    if mine is None:
        return None
    return mine[0].numpy().tobytes(), mine[1].numpy().tobytes()
