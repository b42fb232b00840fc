"""Where a rank is in its data, kept at the step boundary and put back on resume.

``attach(data=...)`` takes one of:

- a ``torch.utils.data.DataLoader`` (or the sampler a DataLoader iterates): hpclaunch follows the
  loader. It counts the batches the loader has *delivered* to the script (not what its workers
  read ahead), the iterations begun, the sampler's epoch where it has one (``DistributedSampler``)
  and torch's CPU random state at the moment the current iteration began (the loader draws its
  workers' base seed, and a ``RandomSampler`` without a generator its order, from it). On resume
  the first iteration of the loader begins where the saved one was: the same epoch, the same random
  state at its start, and the batches already delivered skipped in the sampler (their indices are
  drawn, no sample is read). Only that replay touches the random state; the random state of the
  step boundary is back in place before the first batch is handed over;
- anything with ``state_dict()``/``load_state_dict()`` (a stateful sampler or loader, e.g.
  torchdata's ``StatefulDataLoader``): its own state, saved at the step boundary.

Either is rank-local state (each rank its own position). ``DataPosition.batches()`` is an endless
iterator over a followed loader that begins the next epoch itself (``set_epoch`` where the sampler
has it): the simplest way to draw one batch per step.

Every DataLoader worker of a rank that attached ignores the stop signals (``helper_signals``): a
scheduler's SIGTERM reaches every process of the job, and a worker that dies of it takes its rank's
next step, or its stop save, down with it. torch sets its workers' own SIGTERM handler at their
start; the hook installed here runs right after it.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import multiprocessing.util
import os
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from .helper_signals import die_with_parent, ignore_stop_signals, stop_signals_blocked

__all__ = ["DataPosition", "FollowedLoader", "data_position"]

_INSTALLED = False
# Loaders (or samplers, until the loader that iterates them is found) followed in this process.
_FOLLOWED: weakref.WeakKeyDictionary[Any, FollowedLoader] = weakref.WeakKeyDictionary()


class DataPosition:
    """The rank-local data state a checkpoint holds (``state_dict``/``load_state_dict``)."""

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise NotImplementedError

    def batches(self) -> Iterator[Any]:
        raise TypeError("run.batches() needs attach(data=...) to be a DataLoader")


class StatefulData(DataPosition):
    """An object that keeps its own position (``state_dict``/``load_state_dict``)."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def state_dict(self) -> dict[str, Any]:
        return {"state": self.obj.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.obj.load_state_dict(state["state"])

    def batches(self) -> Iterator[Any]:
        while True:  # (a stateful loader resumes its own iteration)
            yield from self.obj


class FollowedLoader(DataPosition):
    """A DataLoader whose delivered batches hpclaunch counts (see the module docstring)."""

    def __init__(self, loader: Any = None, sampler: Any = None) -> None:
        self.loader = loader
        self.sampler = sampler  # (data=sampler: the loader is found at its first iteration)
        self.iters = 0  # iterations begun
        self.delivered = 0  # batches handed to the script by the current iteration
        self.epoch: int | None = None  # the sampler's epoch when the current iteration began
        self.rng_at_iter = torch.get_rng_state()
        self._resume: dict[str, Any] | None = None  # armed by a load: the next iteration replays it
        self._auto_epoch = 0

    # ---- the checkpoint's view -------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "iters": self.iters,
            "delivered": self.delivered,
            "epoch": -1 if self.epoch is None else self.epoch,
            "rng_at_iter": self.rng_at_iter.clone(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._resume = {k: state[k] for k in ("iters", "delivered", "epoch", "rng_at_iter")}
        # (saved again before the replayed iteration is over, the state must be the saved one's)
        self.rng_at_iter = state["rng_at_iter"].clone()
        self.iters = int(state["iters"])
        self.delivered = int(state["delivered"])
        epoch = int(state["epoch"])
        self.epoch = None if epoch < 0 else epoch
        self._auto_epoch = max(0, self.iters - 1) if self.epoch is None else self.epoch

    # ---- iteration -----------------------------------------------------------------------------

    def iterate(self, loader: Any, original: Any) -> Iterator[Any]:
        """What ``iter(loader)`` returns for a followed loader: the loader's own iterator, counted."""
        self.loader = loader
        resume, self._resume = self._resume, None
        skip = 0
        rng_now = torch.get_rng_state()
        if resume is not None:
            skip = int(resume["delivered"])
            sampler = _sampler_of(loader)
            if self.epoch is not None and hasattr(sampler, "set_epoch"):
                sampler.set_epoch(self.epoch)
            torch.set_rng_state(resume["rng_at_iter"])  # the state the saved iteration began with
        else:
            self.iters += 1
            self.delivered = 0
            self.epoch = _epoch_of(_sampler_of(loader))
            self.rng_at_iter = rng_now
        try:
            with stop_signals_blocked():  # (workers forked here start with the stop signals blocked)
                inner = _iterator_skipping(loader, original, skip)
        finally:
            if resume is not None:
                torch.set_rng_state(rng_now)  # the step boundary's state: the replay drew nothing
        self.delivered = skip
        return _Counted(inner, self)

    def batches(self) -> Iterator[Any]:
        loader = self.loader
        if loader is None:
            raise TypeError("run.batches() needs attach(data=...) to be the DataLoader, not its sampler")
        empty_passes = 0  # (a resumed pass that had ended yields nothing, once)
        while True:
            sampler = _sampler_of(loader)
            if self._resume is None and hasattr(sampler, "set_epoch"):
                sampler.set_epoch(self._auto_epoch)  # (a resumed iteration keeps its saved epoch)
            got = 0
            for batch in loader:
                got += 1
                yield batch
            empty_passes = 0 if got else empty_passes + 1
            if empty_passes > 1:
                raise ValueError("the DataLoader attached as data= yields no batches")
            self._auto_epoch = (self.epoch if self.epoch is not None else self._auto_epoch) + 1


class _Counted:
    """The loader's iterator, counting what it hands over (the loader's own object stays inside)."""

    def __init__(self, inner: Iterator[Any], followed: FollowedLoader) -> None:
        self._inner = inner
        self._followed = followed

    def __iter__(self) -> _Counted:
        return self

    def __next__(self) -> Any:
        batch = next(self._inner)
        self._followed.delivered += 1
        return batch

    def __len__(self) -> int:
        return len(self._inner)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:  # (_shutdown_workers, _num_yielded, ... of torch's)
        return getattr(self._inner, name)


def _sampler_of(loader: Any) -> Any:
    sampler = getattr(loader, "sampler", None)
    batch_sampler = getattr(loader, "batch_sampler", None)
    inner = getattr(batch_sampler, "sampler", None)
    return inner if inner is not None and not hasattr(sampler, "set_epoch") else sampler


def _epoch_of(sampler: Any) -> int | None:
    epoch = getattr(sampler, "epoch", None)
    return int(epoch) if isinstance(epoch, int) else None


class _Skip:
    """How many items the index samplers made during one iteration's creation skip (then 0), and
    the iterations they made."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.made: list[_Skipping] = []


class _Skipping:
    """An index sampler's iteration that begins ``n`` items in (the items are drawn, not read),
    started on its first ``next`` as the sampler's own would be, or by ``start``."""

    def __init__(self, inner: Any, n: int) -> None:
        self._inner, self._n = inner, n
        self._it: Iterator[Any] | None = None

    def start(self) -> None:
        if self._it is None:
            self._it = iter(self._inner)
            for _ in itertools.islice(self._it, self._n):
                pass

    def __iter__(self) -> _Skipping:
        return self

    def __next__(self) -> Any:
        self.start()
        assert self._it is not None
        return next(self._it)


class _SkipFirst:
    """An index sampler whose iterations begin ``skip.n`` items later. A loader makes an iteration
    in its constructor and (with workers) another in its first reset, and advances only the last
    one: the replay starts that one inside its window (``_iterator_skipping``), so that a sampler
    that draws its order from the random state when first advanced (``RandomSampler``) draws it
    from the state the saved iteration began with. A loader with persistent workers keeps this
    object for its later epochs: the skip is 0 once the iteration is made."""

    def __init__(self, inner: Any, skip: _Skip) -> None:
        self.inner, self.skip = inner, skip

    def __iter__(self) -> Iterator[Any]:
        if not self.skip.n:
            return iter(self.inner)
        made = _Skipping(self.inner, self.skip.n)
        self.skip.made.append(made)
        return made

    def __len__(self) -> int:
        return len(self.inner)


def _iterator_skipping(loader: Any, original: Any, skip: int) -> Iterator[Any]:
    """``original(loader)`` (the DataLoader's own ``__iter__``) beginning ``skip`` batches in: in the
    index sampler where the dataset has one (nothing read), else by reading and dropping them."""
    if skip <= 0:
        return original(loader)
    from torch.utils.data import DataLoader, IterableDataset

    if isinstance(loader.dataset, IterableDataset) or not isinstance(loader, DataLoader):
        it = original(loader)
        for _ in itertools.islice(it, skip):
            pass
        return it
    cls = type(loader)
    skipping = _skipping_class(cls)
    holder = _Skip(skip)
    object.__setattr__(loader, "__class__", skipping)
    try:
        setattr(loader, _SKIP_ATTR, holder)  # (read by the skipping class's property)
        it = original(loader)
        if holder.made:
            holder.made[-1].start()  # the one the loader advances: drawn here, in the replay's window
        return it
    finally:
        holder.n = 0
        object.__setattr__(loader, "__class__", cls)
        with contextlib.suppress(AttributeError):
            delattr(loader, _SKIP_ATTR)


_SKIPPING: dict[type, type] = {}
_SKIP_ATTR = "_hpclaunch_skip"


def _skipping_class(cls: type) -> type:
    """``cls`` whose index sampler skips ``_hpclaunch_skip`` items: the loader's iterator reads its
    sampler through ``_index_sampler`` when it begins (and primes its workers from it)."""
    if cls not in _SKIPPING:
        base_property = cls._index_sampler  # type: ignore[attr-defined]

        def _index_sampler(self: Any) -> Any:
            return _SkipFirst(base_property.fget(self), getattr(self, _SKIP_ATTR, None) or _Skip(0))

        _SKIPPING[cls] = type(cls.__name__, (cls,), {"_index_sampler": property(_index_sampler)})
    return _SKIPPING[cls]


# ---- the process's hooks -----------------------------------------------------------------------


def _install() -> None:
    """Once per process: DataLoader iteration goes through ``FollowedLoader`` for followed loaders
    (every other loader iterates exactly as before), and every DataLoader worker ignores the stop
    signals and dies with its rank."""
    global _INSTALLED
    if _INSTALLED:
        return
    from torch.utils.data import DataLoader
    from torch.utils.data._utils import signal_handling

    original_iter = DataLoader.__iter__

    def __iter__(self: Any) -> Any:
        followed = _FOLLOWED.get(self)
        if followed is None:
            sampler = _sampler_of(self)
            followed = _FOLLOWED.pop(sampler, None) if sampler is not None else None
            if followed is not None:
                _FOLLOWED[self] = followed
        if followed is None:
            return original_iter(self)
        return followed.iterate(self, original_iter)

    DataLoader.__iter__ = __iter__  # type: ignore[method-assign]
    torch_handlers = signal_handling._set_worker_signal_handlers

    def _worker_handlers(*args: Any, **kwargs: Any) -> None:
        torch_handlers(*args, **kwargs)  # (torch's SIGBUS/SIGSEGV/SIGFPE reports stay)
        ignore_stop_signals()
        die_with_parent()

    signal_handling._set_worker_signal_handlers = _worker_handlers
    shut_down_workers_at_exit()
    _INSTALLED = True


_SHUTDOWN_HOOKED = False
WORKER_EXIT_WAIT_S = 2.0  # a worker told to end (or never told) has this long before it is killed


def shut_down_workers_at_exit() -> None:
    """At the interpreter's exit, every live multi-process iterator's workers are shut down the
    way its ``__del__`` would (the end-of-work word on their queues), before torch's exit flag turns
    that into a no-op and multiprocessing terminates the daemonic workers with SIGTERM: our workers
    ignore the stop signals, so that SIGTERM left the process waiting for them for ever (a script
    that kept an iterator alive to its end never exited). atexit runs last-registered first: this
    hook, registered after torch's import, runs before torch's and multiprocessing's.

    A rank forked by the rank host is a multiprocessing child: it ends through multiprocessing's
    own exit function and ``os._exit``, where atexit never runs, and that exit function terminates
    and joins the daemonic workers (a rank that failed waited for its workers for ever: CI's SLURM
    chain). Its finalizers with an exit priority run first, so the same hook is also one of those,
    registered in the process that makes the iterator (a fork clears the registry)."""
    global _SHUTDOWN_HOOKED
    if _SHUTDOWN_HOOKED:
        return
    _SHUTDOWN_HOOKED = True
    from torch.utils.data import dataloader

    live: weakref.WeakSet[Any] = weakref.WeakSet()
    workers: weakref.WeakSet[Any] = weakref.WeakSet()  # every worker process those iterators started
    finalized_in: list[int] = []  # the process whose multiprocessing finalizers hold the hook
    cls = dataloader._MultiProcessingDataLoaderIter
    original_init = cls.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        live.add(self)
        workers.update(self._workers)
        if finalized_in[-1:] != [os.getpid()]:
            finalized_in.append(os.getpid())
            multiprocessing.util.Finalize(None, shut_down, exitpriority=100)

    def shut_down() -> None:
        for iterator in list(live):
            with contextlib.suppress(Exception):  # (exiting: a worker already gone is no matter)
                iterator._shutdown_workers()
        # A worker still alive now (its iterator gone or shut down without it ending: torch then
        # "terminates" it with SIGTERM, which ours ignore) would be joined for ever by
        # multiprocessing's exit function: a process that raised out of its loop hung at its exit.
        for worker in list(workers):
            with contextlib.suppress(Exception):  # (not this process's child: a fork's copy)
                worker.join(timeout=WORKER_EXIT_WAIT_S)
                if worker.is_alive():
                    worker.kill()
                    worker.join()

    cls.__init__ = __init__  # type: ignore[method-assign]
    atexit.register(shut_down)


def data_position(data: Any) -> DataPosition:
    """The position of ``attach(data=...)`` (see the module docstring)."""
    from torch.utils.data import DataLoader, Sampler

    _install()
    if isinstance(data, DataLoader) and not hasattr(data, "load_state_dict"):
        followed = FollowedLoader(loader=data)
        _FOLLOWED[data] = followed
        return followed
    if hasattr(data, "state_dict") and hasattr(data, "load_state_dict"):
        return StatefulData(data)
    if isinstance(data, Sampler) or hasattr(data, "set_epoch"):
        followed = FollowedLoader(sampler=data)
        _FOLLOWED[data] = followed
        return followed
    raise TypeError(
        f"attach(data=...) got a {type(data).__name__}: give the DataLoader (or its sampler), or an "
        "object with state_dict()/load_state_dict() that keeps its own position"
    )
