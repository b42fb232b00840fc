"""The objects a rank attached, and the state a checkpoint or a snapshot holds for them.

The layout (DCP's nested state dict, the same on disk and in memory)::

    model        the model's state dict, through torch's distributed state-dict helpers (names
                 without DDP's or compile's prefixes; FSDP2's shards as DTensors, so DCP reshards
                 them on load to any world size and between DDP, FSDP2 and one rank)
    optim        the optimizer's (or optimizers') state, through the same helpers
    <name>       every other attached object's ``state_dict()`` (``scheduler``, ``ema`` ...); a
                 module's through the helpers; ``extra`` (a dict of plain values) as JSON text, so
                 keys added later round-trip too
    hpclaunch    the run's own counters (the step)
    rank_local   rank<r>: this rank's random states (``rng``) and data position (``data``), each
                 rank its own entry (``checkpoint.RANK_LOCAL``)

Loading fills a template of the same structure made from the live objects, then hands each object
its part: the keys and tensor shapes of an object's state dict must be the same now as when it was
saved (a scheduler's, a scaler's, a sampler's are). Nothing is unpickled (``checkpoint.safe_load``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch
from torch import nn

from ..errors import CheckpointError, UserInputError
from .checkpoint import RANK_LOCAL, rank_local_key
from .data_position import DataPosition
from .rng import restore_rng_state, rng_state
from .state_cache import CachedStateDicts
from .tensors import flat_items, local_state_sha256, params_sha256

__all__ = ["RUN_SECTION", "Attached", "Loaded"]

RUN_SECTION = "hpclaunch"
RESERVED = ("model", "optim", RUN_SECTION, RANK_LOCAL)


class Loaded(Protocol):
    """What a load says of the state it filled in (``memory_tier.Restored``, ``LoadResult``)."""

    @property
    def saved_sections(self) -> set[str]: ...

    @property
    def ranks_without_rank_local(self) -> Any: ...


class Attached:
    """The model, its optimizer(s), the named objects and the data position of one rank."""

    def __init__(
        self,
        *,
        model: nn.Module | None,
        optimizers: list[torch.optim.Optimizer],
        objects: Mapping[str, Any],
        data: DataPosition | None,
        rank: int,
        device: torch.device,
        missing: Mapping[str, Callable[[], None]] | None = None,
    ) -> None:
        if optimizers and model is None:
            raise UserInputError(
                "attach(optimizer=...) needs model= too: the optimizer's state is saved by the "
                "model's parameter names",
                where="hpclaunch.attach()",
            )
        for name in objects:
            if name in RESERVED or not name.isidentifier():
                raise UserInputError(f"attach(): {name!r} cannot name an object", where="hpclaunch.attach()")
        if model is not None:
            refuse_optimizers_of_other_modules(model, optimizers)
        self.model = model
        if model is not None:
            fix_ddp_bucket_order(model)
        self.optimizers = optimizers
        self.objects = {name: _stateful(name, obj) for name, obj in objects.items() if obj is not None}
        self.data = data
        self.rank = rank
        self.device = device
        # Sections a checkpoint may lack, and what then happens instead of loading them (the MMDiT
        # trainer's EMA, turned on after the checkpoint was written, starts from the weights).
        self.missing = dict(missing or {})
        one = len(optimizers) == 1 and model is not None
        self._cache = CachedStateDicts(model, optimizers[0]) if one else None  # type: ignore[arg-type]

    @property
    def names(self) -> list[str]:
        return (
            (["model"] if self.model is not None else [])
            + (["optim"] if self.optimizers else [])
            + list(self.objects)
        )

    # ---- out -----------------------------------------------------------------------------------

    def state(self, own: Mapping[str, Any], *, cached: bool = False) -> dict[str, Any]:
        """Everything a checkpoint holds; ``own``: the run's counters. ``cached``: the model's and
        optimizer's state dicts made once and reused (the memory tier's, every few steps)."""
        state: dict[str, Any] = {RUN_SECTION: _tensors(own)}
        model_sd, optim_sd = self._model_and_optim(cached)
        if model_sd is not None:
            state["model"] = model_sd
        if optim_sd is not None:
            state["optim"] = optim_sd
        for name, obj in self.objects.items():
            state[name] = obj.state_dict()
        mine: dict[str, Any] = {"rng": rng_state(self.device)}
        if self.data is not None:
            mine["data"] = self.data.state_dict()
        state[RANK_LOCAL] = {rank_local_key(self.rank): mine}
        return state

    def _model_only(self) -> dict[str, Any] | None:
        if self.model is None:
            return None
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(self.model)

    def _model_and_optim(self, cached: bool) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        if self.model is None:
            return None, None
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        if not self.optimizers:
            return get_model_state_dict(self.model), None
        if cached and self._cache is not None:
            return self._cache.get()
        opts = self.optimizers[0] if len(self.optimizers) == 1 else self.optimizers
        return get_state_dict(self.model, opts)

    # ---- in ------------------------------------------------------------------------------------

    def take(self, state: Mapping[str, Any], loaded: Loaded) -> dict[str, int]:
        """Hand a loaded ``state`` to its objects; returns the run's counters."""
        sections = loaded.saved_sections
        if self.model is not None:
            from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

            if self.optimizers:
                opts = self.optimizers[0] if len(self.optimizers) == 1 else self.optimizers
                set_state_dict(
                    self.model, opts, model_state_dict=state["model"], optim_state_dict=state["optim"]
                )
            else:
                set_model_state_dict(self.model, state["model"])
        for name, obj in self.objects.items():
            if name in sections:
                obj.load_state_dict(state[name])
            elif name in self.missing:
                self.missing[name]()
            else:
                raise CheckpointError(
                    f"the checkpoint holds no state for {name!r}, attached now but not when it was "
                    "saved; attach the same objects, or start a new run directory"
                )
        if self.rank not in loaded.ranks_without_rank_local:
            mine = state[RANK_LOCAL][rank_local_key(self.rank)]
            restore_rng_state(mine["rng"], self.device)
            if self.data is not None and "data" in mine:
                self.data.load_state_dict(mine["data"])
        return {k: int(v) for k, v in state[RUN_SECTION].items()}

    def optional_sections(self) -> set[str]:
        """Top-level sections a checkpoint may lack (loading keeps the template's values)."""
        return {RANK_LOCAL, *self.missing}

    # ---- facts ---------------------------------------------------------------------------------

    def shape_hash(self) -> str:
        """The names, shapes and dtypes of the model's state: a checkpoint of another model never
        loads (its manifest's ``model_hash``)."""
        if self.model is None:
            return "none"
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        h = hashlib.sha256()
        for name, t in sorted(get_model_state_dict(self.model).items()):
            if isinstance(t, torch.Tensor):
                h.update(f"{name}|{t.dtype}|{tuple(t.shape)};".encode())
        return h.hexdigest()[:16]

    def digests(self, *, whole: bool = True) -> dict[str, Any]:
        """``params_sha256`` (the whole model, the same at any world size; collective under FSDP;
        ``whole``: only then), ``state_sha256`` (this rank's part of everything attached) and one
        digest per object."""
        per: dict[str, str] = {}
        # (an optimizer without state yet is hashed as it is: torch's helper would run its first,
        # zero-lr step to make one, and every later step would count from there)
        fresh = any(not opt.state for opt in self.optimizers)
        model_sd, optim_sd = self._model_and_optim(cached=False) if not fresh else (self._model_only(), None)
        if fresh:
            optim_sd = {str(i): opt.state_dict() for i, opt in enumerate(self.optimizers)}
        if model_sd is not None:
            per["model"] = local_state_sha256(
                flat_items("model", _the_ranks_own(self.model, model_sd, self.rank))
            )
        if optim_sd is not None:
            per["optim"] = local_state_sha256(flat_items("optim", optim_sd))
        for name, obj in self.objects.items():
            per[name] = local_state_sha256(flat_items(name, obj.state_dict()))
        if self.data is not None:
            per["data"] = local_state_sha256(flat_items("data", self.data.state_dict()))
        together = hashlib.sha256(json.dumps(per, sort_keys=True).encode()).hexdigest()
        return {
            "params_sha256": params_sha256(self.model) if self.model is not None and whole else None,
            "state_sha256": together,
            "objects": per,
        }


def _the_ranks_own(model: Any, state: dict[str, Any], rank: int) -> dict[str, Any]:
    """The model state that is this rank's own. DDP (``broadcast_buffers``, its default) overwrites
    every rank's buffers (BatchNorm's running statistics) with rank 0's at each forward, so another
    rank's buffers after a step are no state of the run: its checkpoint holds rank 0's, and a
    resumed rank 1 that compared them with its own before the stop saw a difference that the next
    forward erases."""
    from torch.nn.parallel import DistributedDataParallel

    if rank == 0 or not isinstance(model, DistributedDataParallel) or not model.broadcast_buffers:
        return state
    buffers = {name for name, _ in model.module.named_buffers()}
    return {k: v for k, v in state.items() if k not in buffers}


def fix_ddp_bucket_order(model: nn.Module) -> None:
    """Buckets a DDP model's gradients in one order in every process, fresh or resumed.

    DDP buckets the gradients in one order for its first backward pass and rebuilds the buckets,
    once, in the order the gradients became ready. Where an element sits in its bucket decides the
    order in which the ring all-reduce sums the ranks' values, and with three ranks or more that
    order changes the rounding: a process that resumed at step 21 reduced step 21 with the first
    order where the uninterrupted run used the rebuilt one. Pushing every parameter, in index
    order, before the first backward makes each process rebuild to that one layout at its first
    forward (a no-op where the buckets were rebuilt already or are never rebuilt).
    """
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel) and getattr(model, "reducer", None) is not None:
        model.reducer._push_all_rebuilt_params()


def _tensors(counters: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    return {k: torch.tensor(int(v), dtype=torch.int64) for k, v in counters.items()}


class _Module:
    """A module attached by name: its state through the distributed helpers."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(self.module)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(self.module, state)


class _Extra:
    """``extra=``: a dict of plain values kept as JSON text (keys added later round-trip too);
    loading updates the caller's dict in place."""

    def __init__(self, name: str, value: dict[str, Any]) -> None:
        self.name, self.value = name, value
        self.state_dict()  # said at attach, not at the first save some steps later

    def state_dict(self) -> dict[str, Any]:
        try:
            return {"json": json.dumps(self.value, sort_keys=True)}
        except (TypeError, ValueError) as e:
            raise UserInputError(
                f"attach({self.name}=...) must hold plain values (numbers, strings, lists, dicts): {e}",
                where="hpclaunch.attach()",
                hint="attach tensors or objects with state_dict() under names of their own",
            ) from None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value.clear()
        self.value.update(json.loads(state["json"]))


def refuse_optimizers_of_other_modules(model: nn.Module, optimizers: list[torch.optim.Optimizer]) -> None:
    """An optimizer's state is saved by the model's parameter names: one that steps parameters the
    model does not hold (a second model attached under its own name) could not be saved at all
    (torch's helper fails at the first save, after the steps were trained)."""
    own = {id(p) for p in model.parameters()}
    for i, opt in enumerate(optimizers):
        if any(id(p) not in own for group in opt.param_groups for p in group["params"]):
            which = "the optimizer" if len(optimizers) == 1 else f"optimizer {i} of the list"
            # (the fix in the message: raised in the user's script, a traceback shows no hint)
            raise UserInputError(
                f"attach(optimizer=...): {which} steps parameters that are not model='s; several "
                "models: attach them as one, model=nn.ModuleDict({'gen': G, 'disc': D}), with "
                "optimizer=[opt_g, opt_d]",
                where="hpclaunch.attach()",
            )


def _stateful(name: str, obj: Any) -> Any:
    if isinstance(obj, nn.Module):
        return _Module(obj)
    if isinstance(obj, torch.optim.Optimizer):
        raise UserInputError(
            f"attach({name}=...) is an optimizer: pass it as optimizer= (a list for several; several "
            "models: attach them as one, model=nn.ModuleDict({'gen': G, 'disc': D}))",
            where="hpclaunch.attach()",
        )
    if isinstance(obj, dict):
        return _Extra(name, obj)
    if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
        raise UserInputError(
            f"attach({name}=...) has no state_dict()/load_state_dict(): a {type(obj).__name__}",
            where="hpclaunch.attach()",
            hint="attach objects that save and load their own state, or a dict of plain values",
        )
    return obj
