"""DCP save plans cached from one save to the next, so a save does not ship its whole plan again.

Every DCP save gathers each rank's plan on the coordinator and scatters the global plan back, as
pickled objects. For a model of a few hundred tensors that is a large part of the Python work of
a save (``py-spy record --gil`` on ``bench/checkpoint_stall.py``'s model: the cache removed ~40 %
of the samples in which the background writer held the GIL), and whatever GIL the writer holds,
the training thread beside it waits for. The plan only changes when the state dict's structure does, so DCP's own plan
cache (``DefaultSavePlanner(enable_plan_caching=True)``) sends an empty plan from each rank whose
plan is unchanged and reuses the cached global plan.

DCP keeps that cache in class attributes of ``SavePlanner``, keyed by the planner's class name: one
cache for the whole process. Each ``SavePlans`` uses a key of its own instead, so two checkpointers in
one process (tests, a sampler beside a trainer) never reuse each other's plans, and it drops the
entries when it is closed, or when a save fails (a save that failed part-way may have left the
ranks' caches out of step; the next save then starts afresh on every rank, since every rank sees
the failure).
"""

from __future__ import annotations

import uuid
from typing import Any

# The class attributes of torch's SavePlanner that hold cached plans, per key.
_CACHES = (
    "_cached_save_plan",
    "_cached_all_plans",
    "_cached_global_plan",
    "_cached_metadata",
    "_cached_final_save_plan",
)


class SavePlans:
    """Makes the planner for each save of one checkpointer; all of its saves share one plan cache.

    ``planner_class``: a ``DefaultSavePlanner`` subclass (the writer process's reads staged shards).
    """

    def __init__(self, planner_class: type[Any] | None = None) -> None:
        self._key = self._new_key()
        self._planner_class = planner_class

    @staticmethod
    def _new_key() -> str:
        return f"hpclaunch-{uuid.uuid4().hex}"

    def planner(self, **attrs: Any) -> Any:
        """A ``DefaultSavePlanner`` for the next save, caching under this checkpointer's key
        (``attrs``: set on the planner, for a subclass that needs them)."""
        from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

        cls = self._planner_class or DefaultSavePlanner
        try:
            planner = cls(enable_plan_caching=True)
        except TypeError:  # a torch without DCP's plan cache (before 2.6): every save plans afresh
            return cls()
        planner._cached_plans_key = self._key
        for name, value in attrs.items():
            setattr(planner, name, value)
        return planner

    def forget(self) -> None:
        """Drop this checkpointer's cached plans (after a failed save, and on close)."""
        from torch.distributed.checkpoint.planner import SavePlanner

        for name in _CACHES:
            cache = getattr(SavePlanner, name, None)
            if isinstance(cache, dict):
                cache.pop(self._key, None)
        self._key = self._new_key()
