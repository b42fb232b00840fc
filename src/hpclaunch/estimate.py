"""What a run will still take and cost: pure arithmetic over measured seconds (no I/O, no torch).

A run trains in attempts of at most the configured time limit. Every attempt pays an overhead
besides training: start-up (scheduler, node checks, imports, rendezvous, checkpoint load) before
its first step and a tail after its last (the stop save, teardown, the agent's decision), and the
wait in the queue before it. So the steps left take

    training_left = steps_left x seconds_per_step   (periodic checkpoint stalls included)
    per attempt   = time_limit - start-up - tail     of training, at most

and the wall-clock ETA adds one start-up, tail and queue wait per attempt still to come (the
attempt running now keeps what is left of its limit). ``status`` measures the inputs on the run's
own attempts (``orchestrator.accounting``); ``preflight`` on one short step run on this machine,
with the overhead it could see (it says which figures are guesses).

Resource-hours are allocated time x resources: GPU-hours (nodes x gpus_per_node) for GPU runs and
node-hours for CPU runs (a node's price is the site's, not a GPU's, so ``gpu_hour_cost`` prices
GPU-hours only). Both ``status`` and ``preflight`` call ``estimate``; imported by the orchestrator
and preflight, importing nothing of hpclaunch.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class Measured:
    """Per-step and per-attempt seconds, measured (or guessed: ``notes`` says which)."""

    seconds_per_step: float | None
    startup_s: float = 0.0  # per attempt, before the first step
    tail_s: float = 0.0  # per attempt, after the last step (stop save, teardown, decision)
    queue_s: float = 0.0  # per continuation, waiting in the queue
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Progress:
    """Where the run stands."""

    steps_total: int
    steps_done: int
    allocated_s: float = 0.0  # allocated so far (every attempt)
    running_s: float | None = None  # how long the running attempt has held its nodes; None: none runs
    ended: str | None = None  # the run has ended: finished | failed | cancelled | ...


@dataclass(frozen=True)
class Job:
    """What the job holds and what it costs: its time limit, its training nodes and the hot spares
    it holds besides them (for as long, and paid for too), their GPUs and a GPU-hour's price."""

    time_limit_s: float
    nodes: int
    gpus_per_node: int
    spare_nodes: int = 0
    gpu_hour_cost: float | None = None


@dataclass
class Estimate:
    basis: str
    state: str  # estimated | finished | ended | unknown
    seconds_per_step: float | None
    startup_per_attempt_s: float | None
    tail_per_attempt_s: float | None
    queue_per_attempt_s: float | None
    time_limit_s: float
    steps_left: int
    training_left_s: float | None = None
    attempts_left: int | None = None  # attempts still to start (the running one not counted)
    allocated_left_s: float | None = None
    eta_s: float | None = None
    eta_at: float | None = None
    unit: str = "GPU-hours"
    gpus: int = 0
    nodes: int = 1  # every node the job holds: the training nodes and the hot spares
    spare_nodes: int = 0
    gpu_hours_spent: float | None = None
    gpu_hours_to_go: float | None = None
    gpu_hours_total: float | None = None
    node_hours_spent: float = 0.0
    node_hours_to_go: float | None = None
    node_hours_total: float | None = None
    gpu_hour_cost: float | None = None
    cost_spent: float | None = None
    cost_to_go: float | None = None
    cost_total: float | None = None
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """``status --json``'s ``cost`` and ``preflight --json``'s ``estimate``: these fields, floats
        rounded to 4 places."""
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in asdict(self).items()}


def estimate(progress: Progress, measured: Measured, job: Job, *, now: float, basis: str) -> Estimate:
    """The ETA and the resource-hours (and cost) spent and still to go, in ``job``."""
    time_limit_s, spare_nodes, gpu_hour_cost = job.time_limit_s, job.spare_nodes, job.gpu_hour_cost
    nodes = job.nodes + spare_nodes
    gpus = nodes * job.gpus_per_node
    left = max(0, progress.steps_total - progress.steps_done)
    e = Estimate(
        basis=basis,
        state="estimated",
        seconds_per_step=measured.seconds_per_step,
        startup_per_attempt_s=measured.startup_s,
        tail_per_attempt_s=measured.tail_s,
        queue_per_attempt_s=measured.queue_s,
        time_limit_s=time_limit_s,
        steps_left=left,
        unit="GPU-hours" if gpus else "node-hours",
        gpus=gpus,
        nodes=nodes,
        spare_nodes=spare_nodes,
        gpu_hour_cost=gpu_hour_cost,
        notes=list(measured.notes),
    )
    if spare_nodes:
        e.notes.append(
            f"counts the {nodes} nodes the job holds: {nodes - spare_nodes} training + {spare_nodes} hot spare(s)"
        )
    if progress.ended == "finished" or (progress.ended is None and left == 0 and progress.running_s is None):
        e.state, e.training_left_s, e.attempts_left, e.allocated_left_s, e.eta_s = (
            "finished",
            0.0,
            0,
            0.0,
            0.0,
        )
    elif progress.ended is not None:
        e.state = "ended"
        e.notes.append(f"the run has ended ({progress.ended}) with {left} steps left: nothing more is spent")
    elif measured.seconds_per_step is None:
        e.state = "unknown"
        e.notes.append("no step measured yet: the estimate comes with the first logged steps")
    else:
        _remaining(e, progress, measured, time_limit_s, left)
    if e.eta_s is not None:
        e.eta_at = now + e.eta_s
    _hours(e, progress.allocated_s, gpus, nodes, gpu_hour_cost)
    return e


def _remaining(e: Estimate, p: Progress, m: Measured, limit: float, left: int) -> None:
    assert m.seconds_per_step is not None
    training = left * m.seconds_per_step
    per_attempt = limit - m.startup_s - m.tail_s
    if per_attempt <= 0:
        e.state = "unknown"
        e.notes.append(
            f"start-up and stop take {m.startup_s + m.tail_s:.0f} s of a {limit:.0f} s limit: no attempt can train"
        )
        return
    wall = allocated = 0.0
    if p.running_s is not None:  # the attempt running now trains until its limit, less its tail
        now_left = max(0.0, limit - p.running_s - m.tail_s)
        if training <= now_left:
            e.training_left_s, e.attempts_left = training, 0
            e.allocated_left_s = e.eta_s = training + m.tail_s
            return
        training_then = training - now_left
        wall = allocated = limit - p.running_s
    else:
        training_then = training
    attempts = math.ceil(training_then / per_attempt)
    allocated += attempts * (m.startup_s + m.tail_s) + training_then
    wall = wall + attempts * (m.queue_s + m.startup_s + m.tail_s) + training_then
    e.training_left_s, e.attempts_left = training, attempts
    e.allocated_left_s, e.eta_s = allocated, wall


def _hours(e: Estimate, spent_s: float, gpus: int, nodes: int, price: float | None) -> None:
    to_go = e.allocated_left_s
    e.node_hours_spent = nodes * spent_s / 3600
    e.node_hours_to_go = nodes * to_go / 3600 if to_go is not None else None
    e.node_hours_total = e.node_hours_spent + e.node_hours_to_go if e.node_hours_to_go is not None else None
    if not gpus:
        if price is not None:
            e.notes.append(
                "scheduler.gpu_hour_cost prices GPU-hours; this run has no GPUs (node-hours shown)"
            )
        return
    e.gpu_hours_spent = gpus * spent_s / 3600
    e.gpu_hours_to_go = gpus * to_go / 3600 if to_go is not None else None
    e.gpu_hours_total = e.gpu_hours_spent + e.gpu_hours_to_go if e.gpu_hours_to_go is not None else None
    if price is not None:
        e.cost_spent = e.gpu_hours_spent * price
        e.cost_to_go = e.gpu_hours_to_go * price if e.gpu_hours_to_go is not None else None
        e.cost_total = e.gpu_hours_total * price if e.gpu_hours_total is not None else None
