"""``preflight``'s estimate of what a run will take and cost, before it is submitted.

It runs a few training steps of one rank in the job's Python (``trainer/step_probe.py``: this
package never imports torch) and hands the measured step to ``estimate``, as ``status`` does with a
run's own attempts. ``hpclaunch preflight`` asks its probe for them (``step_request``): the probe,
started before the checks, times the steps right after its own answer, with the torch it has
imported already, while the checks run; ``measure_step`` is the same in a process of its own. What it cannot measure here it says: a GPU run on a machine without GPUs
gets no estimate at all; the gradient all-reduce between ranks, the node checks, the rendezvous,
the checkpoint saves and the queue wait are not in it (the start-up it counts is the imports and
the model build it saw).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Literal, TypedDict

from .. import proc
from ..config import RunConfig
from ..estimate import Estimate, Job, Measured, Progress, estimate
from ..probe_shapes import StepMeasure, StepRequest
from .probe import job_python

_SCRIPT = Path(__file__).resolve().parents[1] / "trainer" / "step_probe.py"
TIMEOUT_S = 180.0
STEPS = 3


class CannotEstimate(TypedDict):
    """``preflight_estimate``'s answer where no step could be measured here."""

    state: Literal["cannot"]
    reason: str


def step_request(cfg: RunConfig) -> StepRequest:
    """What the step probe reads: the run's config and how many steps to time after a warm-up."""
    return {"config": cfg.to_dict(), "steps": STEPS}


def step_env(cfg: RunConfig) -> dict[str, str]:
    """The environment the steps are timed in beyond this one: one rank's CPU threads, as the job
    sets them (``RunConfig.omp_threads``: a rank's share of the node less its helpers, or ``launch.env``'s).

    It was the whole task's CPUs: two threads for one rank of the tiny example, whose ranks get one
    each; on two busy cores those two threads made the measured step 10 to 20 times slower.
    """
    threads = str(cfg.omp_threads or 1)
    return {"OMP_NUM_THREADS": str(cfg.launch.env.get("OMP_NUM_THREADS", threads))}


def measure_step(cfg: RunConfig, *, timeout_s: float = TIMEOUT_S) -> StepMeasure:
    """The step probe's answer from a process of its own, or ``{"error": why}``."""
    python = job_python(cfg.launch.python)
    if python is None:
        return {"error": f"the job's Python ({cfg.launch.python}) is not on this machine"}
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", **step_env(cfg)}
    request = json.dumps(step_request(cfg))
    try:
        # -c, not the path: the script's directory would go first on sys.path (see probe.py).
        out = proc.run([python, "-c", _SCRIPT.read_text()], input=request, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"the measured steps took longer than {timeout_s:.0f} s"}
    except OSError as e:
        return {"error": f"cannot start {python}: {e.strerror}"}
    line = next((ln for ln in reversed(out.stdout.splitlines()) if ln.startswith("{")), None)
    if line is None:
        tail = (out.stderr or out.stdout).strip().splitlines()[-1:] or [f"exit code {out.returncode}"]
        return {"error": tail[0][:300]}
    result: StepMeasure = json.loads(line)
    return result


def preflight_estimate(
    cfg: RunConfig, *, step: StepMeasure | None = None, now: float | None = None
) -> Estimate | CannotEstimate:
    """``estimate``'s figures from one rank's measured step, or ``{"state": "cannot", "reason"}``.

    ``step``: the step probe's answer when the caller has it (preflight's probe); else measured here.
    """
    if step is None:
        step = measure_step(cfg)
    if step.get("error"):
        return {"state": "cannot", "reason": f"cannot measure a step here: {step['error']}"}
    s = cfg.scheduler
    notes = [
        f"one rank's step measured on this machine ({step['device']}, {step['steps']} steps after a warm-up)"
    ]
    if s.world_size > 1:
        notes.append(f"the gradient all-reduce between the {s.world_size} ranks is not in it")
    notes.append(
        "start-up counts the imports and model build seen here; node checks, rendezvous, checkpoint "
        "saves and the queue wait are not measured before the run (status measures them)"
    )
    measured = Measured(
        seconds_per_step=float(step["seconds_per_step"]),
        startup_s=float(step.get("imports_s", 0.0)) + float(step.get("build_s", 0.0)),
        notes=tuple(notes),
    )
    job = Job(float(s.time_limit_s), s.nodes, s.gpus_per_node, s.spare_nodes, s.gpu_hour_cost)
    e = estimate(
        Progress(steps_total=cfg.train.steps, steps_done=0),
        measured,
        job,
        now=time.time() if now is None else now,
        basis="preflight: one short measured step",
    )
    return e
