"""The MMDiT trainer's state facts: its digests (model, AdamW and EMA) and AdamW's eager state.
Digests of any tensors and RNG states are the rank package's (``rank.tensors``, ``rank.rng``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..rank.tensors import flat_items, local_state_sha256, params_finite, params_sha256


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
