"""Feeding the loop: one item per optimizer step, prepared by DataLoader workers ahead of time.

Item ``i`` of ``StepBatches`` is everything this rank needs for step ``first_step + i``: the token
ids and latents of its ``accum x micro`` samples (read from the memory-mapped shards), the text
mask when the data pads, and the step's random draws (diffusion times, mask keys, noise). All of
it is a pure function of (seed, step, global sample position), so the workers can prepare steps
in any process and ahead of time: the data position stays one integer, ``samples_consumed``, and
whatever the workers prefetched past a stop is simply dropped.

A worker hands its item over as one ``bytes`` object (every array packed back to back, plus a
small header): a tensor crossing processes costs a shared-memory segment and a file descriptor each
(about a millisecond apiece on a 2-core machine, more than preparing the item), pickled bytes cost
a memcpy. The training process unpacks them into one buffer, pinned on CUDA, and the loop copies
with ``non_blocking=True``; with ``data.num_workers: 0`` items are built in the training process
(same values, no prefetch).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ...config import RunConfig
from ...errors import DataError
from ...rank.data_position import shut_down_workers_at_exit
from ...rank.helper_signals import die_with_parent, ignore_stop_signals, stop_signals_blocked
from ..model.objective import Draws, Losses, Objective, compute_losses, draw
from .dataset import SampleOrder, ShardedDataset, text_mask


@dataclass(frozen=True)
class StepPlan:
    """Which samples a rank reads at which step (world-size dependent, position exact)."""

    seed: int
    first_step: int  # the step the first item is for
    first_position: int  # samples_consumed before that step
    steps: int  # items
    global_batch: int
    rank: int
    per_rank: int
    micro: int
    pad_id: int | None

    @property
    def accum(self) -> int:
        return self.per_rank // self.micro

    def positions(self, i: int, m: int) -> list[int]:
        """Global positions of micro-batch ``m`` of item ``i``."""
        start = self.first_position + i * self.global_batch + self.rank * self.per_rank + m * self.micro
        return list(range(start, start + self.micro))


class StepBatches(torch.utils.data.Dataset[dict[str, Tensor]]):
    """Map-style: item ``i`` = this rank's batch for step ``plan.first_step + i``."""

    def __init__(self, dataset: ShardedDataset, order: SampleOrder, plan: StepPlan):
        self.dataset = dataset
        self.order = order
        self.plan = plan

    def __len__(self) -> int:
        return self.plan.steps

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        p = self.plan
        step = p.first_step + i
        parts: dict[str, list[Any]] = {
            k: [] for k in ("tokens", "latents", "t_text", "t_latent", "keys", "noise")
        }
        masks = []
        problem = None
        for m in range(p.accum):
            positions = p.positions(i, m)
            indices = self.order.indices(positions[0], p.micro)
            ids, lat = self.dataset.get(indices)
            problem = problem or self.dataset.id_problem(ids, indices)
            d = draw(p.seed, step, positions, ids.shape[1], (lat.shape[1], lat.shape[2]))
            parts["tokens"].append(torch.from_numpy(ids))
            parts["latents"].append(torch.from_numpy(lat))
            for key, value in (
                ("t_text", d.t_text),
                ("t_latent", d.t_latent),
                ("keys", d.mask_keys),
                ("noise", d.noise),
            ):
                parts[key].append(value)
            mask = text_mask(ids, p.pad_id)
            if mask is not None:
                masks.append(torch.from_numpy(mask))
        item = {k: torch.stack(v) for k, v in parts.items()}
        item["step"] = torch.tensor(step, dtype=torch.int64)
        if masks:
            item["text_mask"] = torch.stack(masks)
        if problem is not None:  # told to the rank with the item: a worker's exception loses its type
            item[DATA_PROBLEM] = torch.tensor(list(problem.encode()), dtype=torch.uint8)
        return item


DATA_PROBLEM = "data_problem"


class RankDataError(DataError):
    """Bad data that one rank's batch showed (the others have not seen it): this rank says so."""


def raise_data_problem(item: dict[str, Tensor]) -> None:
    """A step's item that read a token id outside the vocabulary ends the run as bad data."""
    if DATA_PROBLEM in item:
        where, _, what = bytes(item[DATA_PROBLEM].tolist()).decode().partition(": ")
        raise RankDataError(
            what, where=where, hint="fix or restore the shard, then hpclaunch submit --resume"
        )


@dataclass
class MicroBatch:
    """One micro-batch on the training device."""

    tokens: Tensor
    latents: Tensor
    draws: Draws
    text_mask: Tensor | None

    def losses(self, model: torch.nn.Module, cfg: RunConfig) -> Losses:
        """The training objective of this micro-batch under ``model`` (the loop's and the DDP
        buckets' pass compute it alike)."""
        return compute_losses(
            model, self.tokens, self.latents, self.draws, Objective.of(cfg), text_mask=self.text_mask
        )


def micro_batches(item: dict[str, Tensor], device: torch.device) -> list[MicroBatch]:
    """Split a step's item into its micro-batches, copied to ``device`` (non-blocking from pinned memory)."""
    moved = {k: v.to(device, non_blocking=True) for k, v in item.items() if k not in ("step", DATA_PROBLEM)}
    out = []
    for m in range(moved["tokens"].shape[0]):
        d = Draws(moved["t_text"][m], moved["t_latent"][m], moved["keys"][m], moved["noise"][m])
        mask = moved["text_mask"][m] if "text_mask" in moved else None
        out.append(MicroBatch(moved["tokens"][m], moved["latents"][m], d, mask))
    return out


Packed = tuple[tuple[tuple[str, str, tuple[int, ...]], ...], bytes]


def pack(item: dict[str, Tensor]) -> Packed:
    """An item as (header, bytes): one object to pickle instead of one shared tensor per array."""
    header = tuple((k, str(v.dtype).removeprefix("torch."), tuple(v.shape)) for k, v in item.items())
    return header, b"".join(v.contiguous().numpy().tobytes() for v in item.values())


def unpack(packed: Packed, *, pin: bool) -> dict[str, Tensor]:
    """Views into one buffer holding ``packed``'s bytes (pinned memory when ``pin``)."""
    header, data = packed
    buf = torch.empty(len(data), dtype=torch.uint8, pin_memory=pin)
    buf.numpy()[:] = np.frombuffer(data, dtype=np.uint8)
    out, offset = {}, 0
    for key, dtype, shape in header:
        dt = getattr(torch, dtype)
        n = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dt).element_size()
        out[key] = buf[offset : offset + n].view(dt).reshape(shape)
        offset += n
    return out


class _Packed(torch.utils.data.Dataset[Packed]):
    def __init__(self, batches: StepBatches):
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, i: int) -> Packed:
        return pack(self.batches[i])


# A scheduler's stop signals reach the workers too; they follow the helpers' signal policy
# (``rank.helper_signals``): ignore them, end when the rank says or with the rank.


def _worker_init(_: int) -> None:
    ignore_stop_signals()
    # The rank's own threads do the math; a worker's job is I/O and small draws.
    torch.set_num_threads(1)
    _let_go_of_the_ranks_connections()
    die_with_parent()


def _let_go_of_the_ranks_connections() -> None:
    """Close this forked worker's copies of the rank's network sockets (gloo's pairs, the c10d
    store). A worker never uses them, but while it holds them a rank that dies does not close its
    connections: its peers saw the death only when the worker noticed its parent gone (torch checks
    every 5 s) and exited, so every crash took ~5 s longer to notice."""
    import socket
    import stat

    for name in os.listdir("/proc/self/fd") if os.path.isdir("/proc/self/fd") else []:
        fd = int(name)
        try:
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            probe = socket.socket(fileno=os.dup(fd))
            family = probe.family
            probe.close()
        except OSError:
            continue
        if family in (socket.AF_INET, socket.AF_INET6):
            with contextlib.suppress(OSError):
                os.close(fd)


def make_loader(
    batches: StepBatches, *, num_workers: int, prefetch_factor: int, pin_memory: bool
) -> Iterator[dict[str, Tensor]]:
    """The items of ``batches`` in step order; with workers, prepared ``prefetch_factor`` steps
    ahead in forked processes (the shards stay mapped, not copied) and pinned when ``pin_memory``."""
    if num_workers == 0:
        yield from (batches[i] for i in range(len(batches)))
        return
    shut_down_workers_at_exit()  # (the workers ignore SIGTERM: multiprocessing's at exit would not end them)
    loader = torch.utils.data.DataLoader(
        _Packed(batches),
        batch_size=None,
        shuffle=False,
        num_workers=num_workers,
        prefetch_factor=prefetch_factor,
        worker_init_fn=_worker_init,
        multiprocessing_context="fork",
        persistent_workers=False,
    )
    # The workers are forked here. Until a worker's `_worker_init` ignores the stop signals, torch's
    # own SIGTERM handler in it would end it (a preemption landing as the first step starts killed
    # a worker, and so the rank, as a crash): they start with the signals blocked (pending, not
    # lost), and a signal meanwhile reaches the rank when the workers are started.
    with stop_signals_blocked():
        batches_iter = iter(loader)
    for packed in batches_iter:
        yield unpack(packed, pin=pin_memory)


def eval_positions(count: int, rank: int, world: int) -> tuple[list[int], int]:
    """This rank's share of a fixed evaluation set of ``count`` items (strided), and the number of
    items every rank processes (the largest share), so that all ranks run the same number of
    forward passes (FSDP's collectives need that); missing items are padded with weight 0."""
    mine = list(range(rank, count, world))
    return mine, -(-count // world)
