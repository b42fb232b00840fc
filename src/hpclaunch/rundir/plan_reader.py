"""A tolerant reader of the run's saved plan, for the sides that show what they can.

``read_plan`` validates the whole plan: the agent, the trainer and a continuation need every field
and must fail on a plan they cannot run. The views (``status``'s time accounting and cost, a new
run's ``init_from`` looking up another run's checkpoints) read plans that an older or newer version
wrote, or that a test wrote by hand, and show what they find rather than fail. Every key read from
``plan.json`` outside this package goes through here, so a renamed field changes one place.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from .clock import applied_limit_s
from .paths import RunPaths


@dataclass(frozen=True)
class PlanView:
    """What the views read from a plan; a key the plan lacks (or holds in a shape this version does
    not know) reads as its default."""

    scheduler: str | None = None
    time_limit_s: float | None = None
    nodes: int = 1  # that train
    spare_nodes: int = 0
    gpus_per_node: int = 0
    checkpoint_dir: str | None = None  # checkpoint.dir when set, else the run's own

    @property
    def applied_limit_s(self) -> float | None:
        """The limit the scheduler applies to each attempt (``rundir.clock.applied_limit_s``);
        None when the plan states none."""
        return None if self.time_limit_s is None else applied_limit_s(self.scheduler, self.time_limit_s)


def read_plan_view(paths: RunPaths) -> PlanView | None:
    """The run's plan as far as it can be read; None when there is no readable, non-empty plan."""
    try:
        data = json.loads(paths.plan.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not data:
        return None
    scheduler = data.get("scheduler")
    checkpoint_dir = data.get("checkpoint_dir")
    return PlanView(
        scheduler=scheduler if isinstance(scheduler, str) else None,
        time_limit_s=_number(data.get("time_limit_s")),
        # An absent, null or zero count reads as the default (as it always has).
        nodes=int(_number(data.get("nodes")) or 1),
        spare_nodes=int(_number(data.get("spare_nodes")) or 0),
        gpus_per_node=int(_number(data.get("gpus_per_node")) or 0),
        checkpoint_dir=checkpoint_dir if isinstance(checkpoint_dir, str) else None,
    )


def read_gpu_hour_cost(paths: RunPaths) -> float | None:
    """``scheduler.gpu_hour_cost`` of the run's ``config.yaml`` (the plan does not carry the price);
    None when it is unset or cannot be read."""
    import yaml  # only status's cost needs it

    try:
        data = yaml.safe_load(paths.config.read_text()) or {}
        value = (data.get("scheduler") or {}).get("gpu_hour_cost")
    except (OSError, yaml.YAMLError, AttributeError):
        return None
    return _number(value)


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    try:
        return float(value) if value is not None else None
    except (TypeError, ValueError):
        return None
