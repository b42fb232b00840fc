"""``status``'s ETA and cost: the run's own attempts measured (``accounting``), then ``estimate``.

Seconds per step = training + periodic checkpoint stalls over the steps they kept, across every
attempt; start-up = the mean of the attempts that reached their first step; tail (stop save,
teardown, decision) = the mean of the attempts that ended; queue = the mean wait of the
continuations. A figure no attempt has shown yet counts as 0 and the estimate's notes say so.
"""

from __future__ import annotations

import time

from ..estimate import Estimate, Job, Measured, Progress, estimate
from ..rundir import RunPaths
from ..rundir.plan_reader import read_gpu_hour_cost, read_plan_view
from .accounting import RunTime

# Run states after which nothing more is spent (status's words; "stopping" and the like: exiting).
# A stopped run is resumable, but until someone resumes it there is no time of arrival to show.
_ENDED = (
    "finished",
    "stopped",
    "failed",
    "cancelled",
    "lost",
    "stopping",
    "finishing",
    "failing",
    "cancelling",
)


def measured(spent: RunTime) -> Measured:
    """What this run's attempts show (see the module docstring)."""
    trained = [a for a in spent.attempts if a.first_step is not None]
    steps = sum(max(0, (a.kept_step or 0) - (a.first_step or 0)) for a in trained)
    seconds = sum(a.training_s + a.stall_s for a in trained)
    ended = [a for a in trained if not a.running]
    waits = [a.queue_s for a in spent.attempts[1:] if a.queue_s is not None]
    notes = []
    if not ended:
        notes.append("no attempt has ended yet: stop saves and teardown not measured (counted as 0)")
    if not waits:
        notes.append("no continuation yet: queue wait between attempts not measured (counted as 0)")
    return Measured(
        seconds_per_step=seconds / steps if steps else None,
        startup_s=_mean([a.startup_s for a in trained]),
        tail_s=_mean([a.end_save_s + a.idle_s for a in ended]),
        queue_s=_mean(waits),
        notes=tuple(notes),
    )


def run_cost(
    paths: RunPaths,
    spent: RunTime,
    *,
    state: str,
    step: int,
    total_steps: int | None,
    now: float | None = None,
) -> Estimate | None:
    """``status --json``'s ``cost``: ETA, GPU-hours (node-hours on CPU) and cost; None without a plan."""
    plan = read_plan_view(paths)
    limit = plan.applied_limit_s if plan is not None else None
    if plan is None or limit is None or not total_steps:
        return None
    running = spent.attempts[-1] if spent.attempts and spent.attempts[-1].running else None
    ended = state if state in _ENDED or state.startswith("lost") else None
    progress = Progress(
        steps_total=total_steps,
        steps_done=step,
        allocated_s=spent.allocated_s,
        running_s=running.allocated_s if running is not None else None,
        ended=ended,
    )
    m = measured(spent)
    attempts = len([a for a in spent.attempts if a.first_step is not None])
    job = Job(
        time_limit_s=limit,
        nodes=plan.nodes,
        spare_nodes=plan.spare_nodes,  # held and paid for as well
        gpus_per_node=plan.gpus_per_node,
        gpu_hour_cost=read_gpu_hour_cost(paths),
    )
    return estimate(
        progress,
        m,
        job,
        now=time.time() if now is None else now,
        basis=f"measured on this run's {attempts} attempt(s)",
    )


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def describe(cost: Estimate | None) -> str | None:
    """One status line: the ETA, the resource-hours spent and to go, the cost."""
    from .accounting import fmt_seconds

    if not cost:
        return None
    spent = cost.gpu_hours_spent if cost.gpus else cost.node_hours_spent
    to_go = cost.gpu_hours_to_go if cost.gpus else cost.node_hours_to_go
    parts = []
    if cost.state == "estimated":
        more = cost.attempts_left
        parts.append(f"ETA {fmt_seconds(cost.eta_s)}" + (f" ({more} more attempt(s))" if more else ""))
    elif cost.state == "unknown":
        parts.append("ETA unknown")
    hours = f"{cost.unit} {spent or 0.0:.2f} spent"
    if to_go is not None and cost.state != "finished":
        hours += f", {to_go:.2f} to go"
    parts.append(hours)
    if cost.cost_total is not None:
        parts.append(f"cost {cost.cost_spent or 0.0:.2f} spent, {cost.cost_total:.2f} in all")
    elif cost.cost_spent is not None:
        parts.append(f"cost {cost.cost_spent:.2f} spent")
    return "; ".join(parts)
