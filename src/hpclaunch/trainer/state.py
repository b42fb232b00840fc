"""Facts about the training state that do not depend on how it is sharded: digests, finiteness,
eager optimizer state, and RNG states in a form checkpoints can hold.

Under FSDP a parameter is a ``DTensor`` holding this rank's shard. ``params_sha256`` gathers each
tensor in turn (a collective: every rank calls it, one tensor's memory at a time), so the digest of
the same weights is the same under DDP and FSDP and at any world size. ``local_state_sha256``
hashes only what this rank holds (no collective): the per-rank list of these is the bitwise
fingerprint of a run at one world size (model, optimizer and EMA).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterable
from typing import Any

import numpy as np
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


def state_digests(model: nn.Module, opt: torch.optim.Optimizer, ema: Any, *, sharded: bool) -> dict[str, Any]:
    """``params_sha256`` (collective under FSDP), ``params_finite`` and ``state_sha256`` (this rank's
    shards of the weights, AdamW's state and the EMA with its update count)."""
    named = [(f"model.{n}", p) for n, p in model.named_parameters()]
    named += flat_items("optim", opt.state_dict()["state"])
    if ema is not None:
        named += [(f"ema.{n}", s) for n, s in zip(ema.names, ema.shadow, strict=True)]
        named.append(("ema.updates", ema.updates))
    return {
        "params_sha256": params_sha256(model),
        "params_finite": params_finite(model, sharded=sharded),
        "state_sha256": local_state_sha256(named),
    }


def params_finite(model: nn.Module, *, sharded: bool) -> bool:
    """Every parameter finite. ``sharded``: each rank checks its shards and all ranks agree (MIN)."""
    flags = [torch.isfinite(local(p.detach())).all() for p in model.parameters()]
    ok = torch.stack(flags).all() if flags else torch.tensor(True)
    if sharded and dist.is_initialized():
        value = ok.to(torch.int32).reshape(1)
        dist.all_reduce(value, op=dist.ReduceOp.MIN)
        return bool(value.item())
    return bool(ok.item())


def init_adamw_state(opt: torch.optim.Optimizer) -> None:
    """Create AdamW's state eagerly, exactly as its first step would (step 0, zero moments).

    DCP's ``get_state_dict`` otherwise initialises it by running a zero-lr step, which would move
    Adam's step count by one in runs that save or resume but not in runs that never do; eager
    state keeps every run on the same arithmetic and gives ``load`` tensors to fill in place
    (also for parameters that never get a gradient, e.g. the clean side's branch in l2t/t2l).
    """
    for group in opt.param_groups:
        # The fused (and capturable) kernels read the step count on the parameters' device; the
        # others keep it on the host, as torch's own first step would.
        on_device = bool(group.get("fused") or group.get("capturable"))
        for p in group["params"]:
            st = opt.state[p]
            if not st:
                st["step"] = torch.zeros((), dtype=torch.float32, device=p.device if on_device else "cpu")
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def rng_state(device: torch.device) -> dict[str, Any]:
    """This rank's RNG states as tensors and plain values (loadable with ``weights_only=True``)."""
    state: Any = np.random.get_state(legacy=True)
    out: dict[str, Any] = {
        "torch_rng": torch.get_rng_state(),
        "python_rng": random.getstate(),
        # numpy's legacy global MT19937 key (a numpy array would need unpickling)
        "numpy_rng": torch.from_numpy(np.asarray(state[1], dtype=np.int64)),
    }
    if device.type == "cuda":
        out["cuda_rng"] = torch.cuda.get_rng_state(device)
    return out


def restore_rng_state(saved: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(saved["torch_rng"])
    version, internal, gauss = saved["python_rng"]  # a round trip may turn tuples into lists
    random.setstate((int(version), tuple(int(x) for x in internal), gauss))
    if device.type == "cuda" and "cuda_rng" in saved:
        torch.cuda.set_rng_state(saved["cuda_rng"], device)
