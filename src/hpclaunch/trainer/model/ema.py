"""An exponential moving average of the model's weights (``train.ema_decay``), sharded like them.

The shadow copy holds one tensor per parameter, cloned from the parameter itself: under FSDP a
``DTensor`` with this rank's shard, under DDP a full tensor. Updates touch local tensors only
(one fused ``lerp`` over all of them after every applied optimizer step; a skipped step leaves
the average alone, like the weights). The decay warms up as ``min(decay, (1 + n) / (10 + n))``
after ``n`` updates, so a short run's average is not dominated by the initial weights; ``n`` is
saved with the shadow, so a resumed run continues the same sequence bit for bit.

``applied()`` swaps the average into the model in place for validation and sampling and swaps the
training weights back afterwards (exact copies both ways, so training is unchanged by it).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TypedDict

import torch
from torch import Tensor, nn

from ...rank.tensors import local


class EMAState(TypedDict):
    """The EMA's part of a checkpoint (``state["ema"]``)."""

    weights: dict[str, Tensor]  # parameter name -> its average (filled in place on load)
    updates: Tensor  # the update count, a 0-d int64 tensor (DCP saves tensors, not ints)


# Wrappers that activation checkpointing and torch.compile put into parameter names.
_WRAPPER_PARTS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def clean_name(name: str) -> str:
    """A parameter's name as checkpoints store it (no wrapper prefixes)."""
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name


class EMA:
    def __init__(self, model: nn.Module, decay: float):
        self.decay = decay
        named = list(model.named_parameters())
        self.names = [clean_name(n) for n, _ in named]
        self.params = [p for _, p in named]
        with torch.no_grad():
            self.shadow = [p.detach().clone() for p in self.params]
        # The local tensors, made once: views of the same storage, which the optimizer and a load
        # update in place (a DTensor's local view per step would be one op per parameter).
        self._local_shadow = [local(s) for s in self.shadow]
        self._local_params = [local(p.detach()) for p in self.params]
        self.updates = 0

    def current_decay(self) -> float:
        n = self.updates
        return min(self.decay, (1 + n) / (10 + n))

    @torch.no_grad()
    def update(self) -> None:
        """Move the average towards the current weights (after an applied optimizer step)."""
        weight = 1.0 - self.current_decay()
        torch._foreach_lerp_(self._local_shadow, self._local_params, weight)
        self.updates += 1

    @torch.no_grad()
    def reset_from_model(self) -> None:
        """Start the average at the current weights (a checkpoint without one, EMA just turned on)."""
        for s, p in zip(self.shadow, self.params, strict=True):
            local(s).copy_(local(p.detach()))
        self.updates = 0

    def state_dict(self) -> EMAState:
        """For the checkpoint: the shadow tensors (filled in place on load) and the update count."""
        return {
            "weights": dict(zip(self.names, self.shadow, strict=True)),
            "updates": torch.tensor(self.updates, dtype=torch.int64),
        }

    def load_state_dict(self, state: EMAState) -> None:
        """After a load filled the shadow tensors in place: the update count."""
        self.updates = int(state["updates"])

    @contextmanager
    def applied(self, before: Any = None) -> Iterator[None]:
        """The model holds the average inside the block, its training weights again after it.

        ``before`` (optional) is called before each swap: FSDP must be resharded then, so that no
        unsharded copy of the other weights survives the swap.
        """
        if before is not None:
            before()
        backup: list[Tensor] = []
        with torch.no_grad():
            for s, p in zip(self.shadow, self.params, strict=True):
                backup.append(local(p.detach()).clone())
                local(p.detach()).copy_(local(s))
        try:
            yield
        finally:
            if before is not None:
                before()
            with torch.no_grad():
                for b, p in zip(backup, self.params, strict=True):
                    local(p.detach()).copy_(b)
