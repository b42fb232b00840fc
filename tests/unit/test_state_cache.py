"""The memory tier's cached state dicts: the live tensors reused, the hyperparameters refreshed, and
the cache dropped when the state dicts turn out not to be the live tensors."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_state_dict

from hpclaunch.rank.state_cache import CachedStateDicts
from hpclaunch.trainer.state import flat_items, init_adamw_state

pytestmark = pytest.mark.fast


def _parts() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    init_adamw_state(opt)
    return model, opt


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, lr: float) -> None:
    for g in opt.param_groups:
        g["lr"] = lr
    model(torch.randn(3, 4)).sum().backward()
    opt.step()


def _values(sd: tuple[dict[str, object], dict[str, object]]) -> list[tuple[str, object]]:
    return [
        (k, v.clone() if isinstance(v, torch.Tensor) else v)
        for k, v in flat_items("", {"m": sd[0], "o": sd[1]})
    ]


def test_a_reused_state_dict_equals_a_new_one_after_steps_and_schedule_changes() -> None:
    model, opt = _parts()
    cache = CachedStateDicts(model, opt)
    cache.get()
    for lr in (5e-4, 2e-4, 1e-4):
        _step(model, opt, lr)
        got, new = _values(cache.get()), _values(get_state_dict(model, opt))
        assert [k for k, _ in got] == [k for k, _ in new]
        for (k, a), (_, b) in zip(got, new, strict=True):
            assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, k
    assert cache.enabled
    assert cache.get()[1]["param_groups"][0]["lr"] == 1e-4


def test_state_dicts_that_are_not_the_live_tensors_are_built_every_time() -> None:
    model, opt = _parts()
    cache = CachedStateDicts(model, opt)
    cache.get()
    first = next(model.parameters())
    first.data = first.data.clone()  # a new storage: the cached dict no longer holds the live tensor
    with torch.no_grad():
        first.add_(1.0)
    got = cache.get()
    assert not cache.enabled
    assert torch.equal(got[0]["0.weight"], first)
