"""Facts about tensors and module state that do not depend on how it is sharded: digests and
finiteness.

Under FSDP a parameter is a ``DTensor`` holding this rank's shard. ``params_sha256`` gathers each
tensor in turn (a collective: every rank calls it, one tensor's memory at a time), so the digest of
the same weights is the same under DDP and FSDP and at any world size. ``local_state_sha256``
hashes only what this rank holds (no collective): the per-rank list of these is the bitwise
fingerprint of a run at one world size.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn


def is_dtensor(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def local(t: Tensor) -> Tensor:
    """This rank's part of ``t`` (the tensor itself when it is not sharded)."""
    return t.to_local() if is_dtensor(t) else t  # type: ignore[attr-defined]


def full(t: Tensor) -> Tensor:
    """The whole tensor (a collective for a DTensor)."""
    return t.full_tensor() if is_dtensor(t) else t  # type: ignore[attr-defined]


def _update(h: Any, name: str, t: Tensor) -> None:
    t = t.detach().to("cpu").contiguous().reshape(-1)
    h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
    h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")


def params_sha256(model: nn.Module) -> str:
    """sha256 over the model's state dict (names, dtypes, shapes, bytes of the whole tensors), in
    name order. Collective under FSDP."""
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        _update(h, name, full(tensor))
    return h.hexdigest()


def local_state_sha256(named: Iterable[tuple[str, Any]]) -> str:
    """sha256 over this rank's part of every tensor in ``named`` (no collective)."""
    h = hashlib.sha256()
    for name, value in named:
        if isinstance(value, Tensor):
            _update(h, name, local(value))
        else:
            h.update(f"{name}={value!r}|".encode())
    return h.hexdigest()


def flat_items(prefix: str, obj: Any) -> list[tuple[str, Any]]:
    """(dotted key, leaf) of a nested dict/list, keys in sorted order (optimizer state dicts)."""
    if isinstance(obj, dict):
        out: list[tuple[str, Any]] = []
        for key in sorted(obj, key=str):
            out += flat_items(f"{prefix}.{key}", obj[key])
        return out
    if isinstance(obj, (list, tuple)):
        return [item for i, v in enumerate(obj) for item in flat_items(f"{prefix}.{i}", v)]
    return [(prefix, obj)]


def params_finite(model: nn.Module, *, sharded: bool) -> bool:
    """Every parameter finite. ``sharded``: each rank checks its shards and all ranks agree (MIN)."""
    flags = [torch.isfinite(local(p.detach())).all() for p in model.parameters()]
    ok = torch.stack(flags).all() if flags else torch.tensor(True)
    if sharded and dist.is_initialized():
        value = ok.to(torch.int32).reshape(1)
        dist.all_reduce(value, op=dist.ReduceOp.MIN)
        return bool(value.item())
    return bool(ok.item())
