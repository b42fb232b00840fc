"""DCP's state dicts of the model and optimizer, made once and reused by the memory tier.

``get_state_dict`` maps every parameter to its fully qualified name on each call: 7 ms for the tiny
model on this machine, more than the rest of a snapshot's stall. What it returns does not change
between steps but for the optimizer's hyperparameters: the tensors are the live ones (the
parameters, or their shards, and the optimizer's state, updated in place), so a snapshot may reuse
them and copy only the hyperparameters (the learning rate changes every step) from the live groups.

That the tensors are the live ones is checked, not assumed: the second call also builds the state
dicts anew and compares every tensor's storage; if any differs (a wrapper that copies), the cache
is dropped and every call builds them anew, as before.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from .tensors import flat_items, local

log = logging.getLogger("hpclaunch.trainer")


class CachedStateDicts:
    """``get_state_dict(model, opt)``, built once and refreshed where it changes."""

    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        self.model, self.opt = model, opt
        self._cached: tuple[dict[str, Any], dict[str, Any]] | None = None
        self._checked = False
        self.enabled = True

    def get(self) -> tuple[dict[str, Any], dict[str, Any]]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        if not self.enabled or self._cached is None:
            built = get_state_dict(self.model, self.opt)
            if self.enabled:
                self._cached = built
            return built
        model_sd, optim_sd = self._cached
        groups = [
            {**{k: v for k, v in live.items() if k != "params"}, "params": cached["params"]}
            for live, cached in zip(self.opt.param_groups, optim_sd["param_groups"], strict=True)
        ]
        refreshed = (model_sd, {**optim_sd, "param_groups": groups})
        if not self._checked:
            self._checked = True
            if not _same_storage(refreshed, get_state_dict(self.model, self.opt)):
                log.warning(
                    "the state dicts are not the live tensors: the memory tier builds them every time"
                )
                self.enabled, self._cached = False, None
                return get_state_dict(self.model, self.opt)
        return refreshed


def _same_storage(a: tuple[dict[str, Any], dict[str, Any]], b: tuple[dict[str, Any], dict[str, Any]]) -> bool:
    """The same keys, every tensor on the same storage, every other value equal."""
    left = flat_items("", {"model": a[0], "optim": a[1]})
    right = flat_items("", {"model": b[0], "optim": b[1]})
    if [k for k, _ in left] != [k for k, _ in right]:
        return False
    for (_, x), (_, y) in zip(left, right, strict=True):
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return False
        if isinstance(x, torch.Tensor):
            if local(x).data_ptr() != local(y).data_ptr():
                return False
        elif x != y:
            return False
    return True
