"""The save interval: Young/Daly with worked numbers, the run's MTBF from config and ledger, and the
schedule every rank follows (calibration, a first save that measures, the interval from its cost)."""

from __future__ import annotations

import math
import re

import pytest

from hpclaunch.config import load_config
from hpclaunch.errors import ConfigError
from hpclaunch.rank.checkpoint.save_interval import (
    CALIBRATION_STEPS,
    Policy,
    SaveSchedule,
    expected_loss_per_failure_s,
    expected_waste_share,
    ledger_failures,
    policy_from_config,
    run_mtbf_s,
    young_daly_interval_s,
)
from hpclaunch.rundir.events import as_events

pytestmark = pytest.mark.fast


def test_young_daly_worked_example() -> None:
    # A save costs training 0.5 s; a node fails every 5,000 h; 8 nodes: the run fails every
    # 5000 x 3600 / 8 = 2,250,000 s. Interval = sqrt(2 x 0.5 x 2,250,000) = sqrt(2,250,000) = 1,500 s.
    mtbf = run_mtbf_s(5000, 8, failures=0, trained_s=0)
    assert mtbf == 2_250_000
    interval = young_daly_interval_s(0.5, mtbf)
    assert interval == 1500
    # A failure loses half an interval of work: 750 s (issue 26: not the whole waste over one MTBF).
    assert expected_loss_per_failure_s(interval) == 750
    # Over one MTBF: 2,250,000 / 1,500 = 1,500 saves of 0.5 s (750 s) + the 750 s a failure loses =
    # 1,500 s of 2,250,000 s, 0.0667 %; twice or half the interval wastes more (1,875 s).
    assert expected_waste_share(interval, 0.5, mtbf) == pytest.approx(1500 / mtbf)
    assert expected_waste_share(3000, 0.5, mtbf) == pytest.approx(1875 / mtbf)
    assert expected_waste_share(750, 0.5, mtbf) == pytest.approx(1875 / mtbf)
    # A 4x dearer save: twice the interval (sqrt scaling).
    assert young_daly_interval_s(2.0, mtbf) == 3000


def test_the_ledger_corrects_the_configured_mtbf() -> None:
    # The configured 2,250,000 s counts as one failure's worth of evidence; 2 failures seen in
    # 90,000 s of this run: (2,250,000 + 90,000) / (1 + 2) = 780,000 s.
    assert run_mtbf_s(5000, 8, failures=2, trained_s=90_000) == 780_000
    assert run_mtbf_s(1, 1, failures=0, trained_s=0) == 3600


def test_failures_are_attempts_that_resumed_and_ended_without_a_clean_stop() -> None:
    events = [
        {"event": "resumed", "attempt": "j.0", "ts": 100.0},
        {"event": "checkpoint_saved", "attempt": "j.0", "ts": 160.0},  # then killed: a failure
        {"event": "resumed", "attempt": "j.1", "ts": 200.0},
        {"event": "stopped", "attempt": "j.1", "ts": 500.0},  # a time limit: not a failure
        {"event": "resumed", "attempt": "j.2", "ts": 600.0},
        {"event": "requeued", "attempt": "j.2", "ts": 650.0},  # died at 650 (no stop): a failure
        {"event": "resumed", "attempt": "j.3", "ts": 700.0},  # the attempt asking: left out
    ]
    failures, trained = ledger_failures(as_events(events), current_attempt="j.3")
    assert failures == 2
    assert trained == (160 - 100) + (500 - 200) + (650 - 600)


def schedule(mode: str, **kw: float | int | None) -> SaveSchedule:
    policy = Policy(mode, kw.get("every_steps"), kw.get("every_minutes"), float(kw.get("mtbf", 7200.0)))  # type: ignore[arg-type, arg-type]
    return SaveSchedule(policy, start_step=int(kw.get("start", 100) or 0))


def steps(s: SaveSchedule, first: int, last: int, seconds: float, *, saving: bool = False) -> None:
    for _ in range(first, last + 1):
        s.observe(seconds, saving=saving)


def test_auto_saves_once_to_measure_then_uses_the_measured_cost() -> None:
    s = schedule("auto", mtbf=7200.0, start=100)
    steps(s, 101, 100 + CALIBRATION_STEPS, 0.5)  # the first is warm-up: 4 steady steps of 0.5 s
    step = 100 + CALIBRATION_STEPS
    assert s.calibrating(step) and not s.due(step)
    first = s.propose(step)
    assert first["interval_steps"] == 0 and first["next_step"] == step and first["save_cost_s"] is None
    s.adopt(first)
    assert s.due(step)  # saved right away: nothing measured yet
    s.save_started(step, stall_s=0.05)
    assert not s.due(step + 1)  # no next save before this one has settled and been measured
    steps(s, step + 1, step + 4, 0.75, saving=True)  # 4 steps 0.25 s slower beside the writer
    s.save_settled()
    assert s.save_cost_s == pytest.approx(0.05 + 4 * 0.25)
    nxt = s.propose(step + 4)
    # sqrt(2 x 1.05 s x 7200 s) = 122.96 s = 246 steps of 0.5 s, counted from the save's step.
    assert nxt["interval_s"] == pytest.approx(math.sqrt(2 * 1.05 * 7200), abs=1e-3)
    assert nxt["interval_steps"] == 246 and nxt["next_step"] == step + 246
    assert nxt["expected_loss_per_failure_s"] == pytest.approx(math.sqrt(2 * 1.05 * 7200) / 2, abs=1e-2)
    s.adopt(nxt)
    assert not s.due(step + 245) and s.due(step + 246)


def test_every_minutes_becomes_steps_from_the_measured_step_time() -> None:
    s = schedule("minutes", every_minutes=1.0, start=0)
    steps(s, 1, CALIBRATION_STEPS, 0.2)
    decision = s.propose(CALIBRATION_STEPS)
    assert decision["interval_steps"] == 300 and decision["next_step"] == 300  # 60 s / 0.2 s
    s.adopt(decision)
    assert s.due(300) and not s.due(299)


def test_a_fixed_interval_is_every_rank_s_own_and_its_figures_are_still_reported() -> None:
    s = schedule("steps", every_steps=50, start=0)
    assert s.due(50) and s.due(100) and not s.due(75)
    steps(s, 1, 10, 0.1)
    s.save_started(50, stall_s=0.2)
    s.save_settled()
    decision = s.propose(51)
    assert decision["interval_steps"] == 50 and decision["interval_s"] == pytest.approx(5.0)
    # A failure loses 5 / 2 = 2.5 s; over one MTBF 7200 x 0.2 / 5 + 2.5 = 290.5 s of 7200 s are lost.
    assert decision["expected_loss_per_failure_s"] == pytest.approx(2.5)
    assert decision["expected_waste_share"] == pytest.approx(290.5 / 7200, abs=1e-6)


def test_config_picks_the_policy() -> None:
    assert policy_from_config("auto", None, 10, 2, failures=0, trained_s=0).mode == "auto"
    assert policy_from_config(50, 30.0, 10, 2, failures=0, trained_s=0).mode == "minutes"
    p = policy_from_config(50, None, 10, 2, failures=0, trained_s=0)
    assert (p.mode, p.every_steps, p.mtbf_s) == ("steps", 50, 18000)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("0", "checkpoint.every_steps: 0 is not a step count: use a whole number >= 1, or auto"),
        ("fast", "checkpoint.every_steps: 'fast' is not a step count"),
        ("2.5", "checkpoint.every_steps: 2.5 is not a step count"),
    ],
)
def test_a_bad_interval_dies_at_load_with_the_key(value: str, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, [f"checkpoint.every_steps={value}"])
    with pytest.raises(ConfigError, match=r"checkpoint\.mtbf_hours"):
        load_config(None, ["checkpoint.mtbf_hours=0"])
    assert load_config(None, ["checkpoint.every_steps=auto"]).checkpoint.every_steps == "auto"


@pytest.mark.parametrize("value", ["0", "65", "many", "1.5"])
def test_a_bad_write_thread_count_dies_at_load_with_the_key(value: str) -> None:
    with pytest.raises(ConfigError, match=r"checkpoint\.write_threads: .* is not a thread count"):
        load_config(None, [f"checkpoint.write_threads={value}"])
    assert load_config(None, []).checkpoint.write_threads == "auto"
    assert load_config(None, ["checkpoint.write_threads=4"]).checkpoint.write_threads == 4
