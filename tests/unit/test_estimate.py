"""ETA, resource-hours and cost (``estimate``, ``orchestrator.cost``) on a recorded ledger.

``recorded/requeued_run`` is a real run's directory (ledger, metrics.jsonl, plan, config) as the
local scheduler left it: 120 steps in 25 s attempts, stopped at its limit and requeued twice,
finished in the third attempt. The tests cut its ledger where the run stood after the second
requeue (as ``status`` saw it then) and check the estimate against the figures measured on it.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
from tests.runlib import hpclaunch

from hpclaunch.estimate import Job, Measured, Progress, estimate
from hpclaunch.orchestrator.accounting import account
from hpclaunch.orchestrator.cost import measured
from hpclaunch.orchestrator.status import summarize
from hpclaunch.rundir import RunPaths, read_events
from hpclaunch.rundir.events import as_events
from hpclaunch.rundir.metrics import MetricsLine, read_metrics

pytestmark = pytest.mark.fast

RECORDED = Path(__file__).resolve().parent / "recorded" / "requeued_run"
AFTER_SECOND_REQUEUE = 1795545687.0  # attempt 2 requeued at step 107, attempt 3 not yet started
LIMIT = 25.0


def cut_ledger(until: float) -> tuple[list[dict], list[MetricsLine]]:
    events = [e for e in (e.record for e in read_events(RunPaths(RECORDED)).events) if e["ts"] <= until]
    metrics = [m for m in read_metrics(RECORDED / "metrics.jsonl") if (m.ts or 0.0) <= until]
    return events, metrics


def test_measured_inputs_come_from_the_attempts() -> None:
    events, metrics = cut_ledger(AFTER_SECOND_REQUEUE)
    spent = account(as_events(events), metrics, time_limit_s=LIMIT)
    a1, a2 = spent.attempts
    assert (a1.first_step, a1.kept_step, a2.first_step, a2.kept_step) == (0, 54, 54, 107)
    m = measured(spent)
    assert m.seconds_per_step == pytest.approx(
        (a1.training_s + a1.stall_s + a2.training_s + a2.stall_s) / 107
    )
    assert m.startup_s == pytest.approx((a1.startup_s + a2.startup_s) / 2) and m.startup_s > 1
    assert m.tail_s == pytest.approx((a1.end_save_s + a1.idle_s + a2.end_save_s + a2.idle_s) / 2)
    assert m.queue_s == pytest.approx(a2.queue_s)
    assert m.notes == ()


def test_eta_gpu_hours_and_cost_between_attempts() -> None:
    events, metrics = cut_ledger(AFTER_SECOND_REQUEUE)
    spent = account(as_events(events), metrics, time_limit_s=LIMIT)
    m = measured(spent)
    # As if the same run had held 2 nodes of 8 GPUs each at 2.5 a GPU-hour.
    e = estimate(
        Progress(steps_total=120, steps_done=107, allocated_s=spent.allocated_s),
        m,
        Job(time_limit_s=LIMIT, nodes=2, gpus_per_node=8, gpu_hour_cost=2.5),
        now=AFTER_SECOND_REQUEUE,
        basis="recorded",
    )
    assert m.seconds_per_step is not None
    training = 13 * m.seconds_per_step
    assert e.state == "estimated" and e.steps_left == 13 and e.attempts_left == 1
    assert e.training_left_s == pytest.approx(training)
    assert e.allocated_left_s == pytest.approx(m.startup_s + m.tail_s + training)
    assert e.eta_s == pytest.approx(m.queue_s + m.startup_s + m.tail_s + training)
    assert e.eta_at == pytest.approx(AFTER_SECOND_REQUEUE + e.eta_s)
    assert e.gpu_hours_spent == pytest.approx(16 * spent.allocated_s / 3600)
    assert e.gpu_hours_to_go == pytest.approx(16 * e.allocated_left_s / 3600)
    assert e.cost_total == pytest.approx(2.5 * (e.gpu_hours_spent + e.gpu_hours_to_go))
    # The third attempt really took about that long (the recorded run's own end).
    finished = next(
        x for x in [e.record for e in read_events(RunPaths(RECORDED)).events] if x["event"] == "finished"
    )
    last_end = max(x["ts"] for x in events)
    assert finished["ts"] - last_end == pytest.approx(e.eta_s, rel=0.5)


def test_attempts_needed_follow_the_time_limit() -> None:
    m = Measured(seconds_per_step=2.0, startup_s=60.0, tail_s=30.0, queue_s=600.0)
    e = estimate(
        Progress(steps_total=1000, steps_done=100, allocated_s=3600.0, running_s=1000.0),
        m,
        Job(time_limit_s=3600.0, nodes=1, gpus_per_node=4, gpu_hour_cost=None),
        now=0.0,
        basis="t",
    )
    # 1800 s of training: 2570 s left in the running attempt covers it.
    assert (e.attempts_left, e.eta_s, e.cost_total) == (0, 1830.0, None)
    e = estimate(
        Progress(steps_total=10000, steps_done=100, running_s=1000.0),
        m,
        Job(time_limit_s=3600.0, nodes=1, gpus_per_node=0, gpu_hour_cost=3.0),
        now=0.0,
        basis="t",
    )
    rest = 9900 * 2.0 - (3600.0 - 1000.0 - 30.0)
    attempts = math.ceil(rest / (3600.0 - 90.0))
    assert e.attempts_left == attempts
    assert e.eta_s == pytest.approx(2600.0 + attempts * (600.0 + 90.0) + rest)
    assert e.unit == "node-hours" and e.gpu_hours_spent is None and e.cost_total is None
    assert any("prices GPU-hours" in n for n in e.notes)


@pytest.mark.spawns
def test_status_json_has_eta_gpu_hours_and_cost(tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(RECORDED, run)
    plan = json.loads((run / "plan.json").read_text())
    (run / "plan.json").write_text(json.dumps({**plan, "gpus_per_node": 8, "run_dir": str(run)}))
    (run / "config.yaml").write_text(
        (run / "config.yaml").read_text().replace("gpu_hour_cost: null", "gpu_hour_cost: 2.5")
    )
    # Between attempts (the ledger as it was after the second requeue): estimated.
    between = tmp_path / "between"
    shutil.copytree(run, between)
    for f in [*(between / "events").glob("*.jsonl"), between / "metrics.jsonl"]:
        lines = [ln for ln in f.read_text().splitlines() if json.loads(ln)["ts"] <= AFTER_SECOND_REQUEUE]
        f.write_text("".join(ln + "\n" for ln in lines))
    view = summarize(between, scheduler_status=None).to_json()
    assert view["state"] == "requeued"
    cost = view["cost"]
    assert cost["state"] == "estimated" and cost["attempts_left"] == 1 and view["eta_s"] == cost["eta_s"] > 0
    assert cost["gpu_hours_spent"] > 0 and cost["cost_total"] == pytest.approx(
        2.5 * cost["gpu_hours_total"], rel=1e-3
    )
    # The finished run through the real CLI: nothing left, what was spent.
    data = json.loads(hpclaunch("status", str(run), "--json", cwd=tmp_path).stdout)
    cost = data["cost"]
    assert {"eta_s", "eta_at", "gpu_hours_spent", "gpu_hours_to_go", "cost_spent", "cost_total"} <= set(cost)
    assert (cost["state"], cost["eta_s"], cost["gpu_hours_to_go"]) == ("finished", 0.0, 0.0)
    assert cost["gpu_hours_spent"] == pytest.approx(8 * data["time"]["allocated_s"] / 3600, rel=1e-3)
    assert cost["cost_spent"] == pytest.approx(2.5 * cost["gpu_hours_spent"], rel=1e-3)


def test_cost_counts_the_hot_spares_the_job_holds(tmp_path: Path) -> None:
    """Issue 26: 2 training + 1 spare x 8 GPUs for 1 h said 16 GPU-hours; 24 were held."""
    run = tmp_path / "run"
    shutil.copytree(RECORDED, run)
    plan = json.loads((run / "plan.json").read_text())
    held = {**plan, "nodes": 2, "spare_nodes": 1, "gpus_per_node": 8, "run_dir": str(run)}
    (run / "plan.json").write_text(json.dumps(held))
    view = summarize(run, scheduler_status=None).to_json()
    cost = view["cost"]
    allocated_h = view["time"]["allocated_s"] / 3600
    assert cost["gpus"] == 24 and cost["nodes"] == 3 and cost["spare_nodes"] == 1
    assert cost["gpu_hours_spent"] == pytest.approx(24 * allocated_h, rel=1e-3)
    assert any("2 training + 1 hot spare(s)" in n for n in cost["notes"])
    one_hour = estimate(
        Progress(steps_total=10, steps_done=10, allocated_s=3600.0),
        Measured(seconds_per_step=1.0),
        Job(time_limit_s=3600.0, nodes=2, gpus_per_node=8, spare_nodes=1, gpu_hour_cost=None),
        now=0.0,
        basis="t",
    )
    assert one_hour.gpu_hours_spent == pytest.approx(24.0)


def test_the_json_names_every_field_of_the_estimate_with_floats_rounded() -> None:
    """``Estimate.to_json()`` (status's ``cost``, preflight's ``estimate``): every field, key for key."""
    from dataclasses import fields

    from hpclaunch.estimate import Estimate

    e = estimate(
        Progress(steps_total=10, steps_done=2),
        Measured(seconds_per_step=1.0 / 3),
        Job(time_limit_s=100.0, nodes=1, gpus_per_node=0), now=0.0, basis="test",
    )  # fmt: skip
    data = e.to_json()
    assert set(data) == {f.name for f in fields(Estimate)}
    assert data["seconds_per_step"] == 0.3333 and data["steps_left"] == 8


def test_status_shows_a_scripts_own_scalars_where_it_logs_no_loss(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A GAN's run.log(loss_d=..., loss_g=...): status showed "step 20/50" and nothing of them."""
    from hpclaunch.cli import main

    run = tmp_path / "run"
    shutil.copytree(RECORDED, run)
    lines = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    kept = ("step", "ts", "attempt", "step_time_s")  # what hpclaunch writes beside a script's values
    lines = [
        {**{k: ln[k] for k in kept}, "loss_d": ln["loss"], "loss_g": 2 * ln["loss"], "on": True}
        for ln in lines
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(ln) + "\n" for ln in lines))
    view = summarize(run, scheduler_status=None)
    last = lines[-1]["loss_d"]
    assert view.loss is None and view.logged == {"loss_d": last, "loss_g": 2 * last}
    assert main(["status", str(run)]) == 0
    assert f"loss_d {last:.4g}  loss_g {2 * last:.4g}" in capsys.readouterr().out
