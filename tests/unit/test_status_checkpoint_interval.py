"""``status`` shows the save interval the trainer chose last and what a failure is expected to cost."""

from __future__ import annotations

import pytest

from hpclaunch.orchestrator.checkpoint_interval import checkpoint_interval_summary, describe
from hpclaunch.rundir.events import as_events

pytestmark = pytest.mark.fast


def decision(**kw: object) -> dict[str, object]:
    base = {
        "event": "checkpoint_interval",
        "attempt": "7.0",
        "step": 120,
        "mode": "auto",
        "interval_steps": 246,
        "interval_s": 122.96,
        "next_step": 356,
        "save_cost_s": 1.05,
        "step_time_s": 0.5,
        "mtbf_s": 7200.0,
        "expected_loss_per_failure_s": 61.48,
    }
    return {**base, **kw}


def test_the_last_decision_is_shown_with_its_figures() -> None:
    events = [decision(interval_steps=0, interval_s=None, save_cost_s=None), {"event": "other"}, decision()]
    summary = checkpoint_interval_summary(as_events(events))
    assert summary is not None and summary.interval_steps == 246 and summary.attempt == "7.0"
    assert describe(summary) == (
        "checkpoints: every 246 steps (~2.0 min) [auto, Young/Daly; a save costs 1.050 s of training; "
        "MTBF 2.0 h]; a failure is expected to lose ~61.5 s of training; saves and failures together "
        "~1.71% of training time"
    )


def test_the_loss_per_failure_is_half_an_interval_even_from_an_old_ledger() -> None:
    """Issue 26: "expected loss per failure ~154.1 h" (more than the MTBF at times) was the whole
    waste over one MTBF. A ledger written before the fix still recorded that figure."""
    old = decision(
        interval_s=2.0, save_cost_s=0.05, mtbf_s=18_000_000.0, expected_loss_per_failure_s=450001.0
    )
    summary = checkpoint_interval_summary(as_events([old]))
    assert summary is not None and summary.expected_loss_per_failure_s == 1.0
    assert summary.expected_waste_share == pytest.approx(0.05 / 2.0 + 2.0 / 36_000_000, rel=1e-4)
    line = describe(summary)
    assert (
        line is not None
        and "a failure is expected to lose ~1.0 s of training" in line
        and "h of training" not in line
    )


def test_before_anything_is_measured_and_for_runs_without_decisions() -> None:
    first = checkpoint_interval_summary(
        as_events([decision(interval_steps=0, interval_s=None, save_cost_s=None)])
    )
    assert describe(first) == "checkpoints: saving once to measure what a save costs (auto, Young/Daly)"
    assert checkpoint_interval_summary(as_events([])) is None and describe(None) is None
    fixed = describe(
        checkpoint_interval_summary(as_events([decision(mode="steps", interval_steps=50, interval_s=5.0)]))
    )
    assert fixed is not None and fixed.startswith(
        "checkpoints: every 50 steps (~5.0 s) [checkpoint.every_steps;"
    )


def test_status_shows_the_loss_the_trainer_recorded_to_the_last_digit() -> None:
    """CI: the trainer recorded 0.718 s, `status` showed 0.719 s. The trainer halved the unrounded
    interval, `status` the rounded one it reads back; now both halve what the ledger keeps."""
    from hpclaunch.rank.checkpoint.save_interval import Policy, SaveSchedule

    for cost in (0.0001 * k for k in range(1, 400)):
        s = SaveSchedule(Policy("auto", None, None, 0.0004 * 3600), start_step=0)
        for _ in range(8):
            s.observe(0.02, saving=False)
        s.save_started(8, stall_s=cost)
        s.save_settled()
        recorded = {"event": "checkpoint_interval", **s.propose(9)}
        shown = checkpoint_interval_summary(as_events([recorded]))
        assert shown is not None and recorded["expected_loss_per_failure_s"] is not None
        assert shown.expected_loss_per_failure_s == recorded["expected_loss_per_failure_s"], cost


def test_auto_in_a_short_run_is_bounded_by_the_run_and_says_so() -> None:
    """Issue 39 (3): a 60-step run (~1.5 s of training) was told "every 179898 steps (~52.1 min) ... a
    failure is expected to lose ~26.1 min": an interval the run never reaches, a loss it cannot have."""
    from hpclaunch.rank.checkpoint.save_interval import Policy, SaveSchedule

    s = SaveSchedule(Policy("auto", None, None, 24 * 3600.0, last_step=60), start_step=0)
    for _ in range(6):
        s.observe(0.025, saving=False)
    s.save_started(5, stall_s=0.01)
    s.save_settled()
    decided = s.propose(6)
    assert decided["bounded_by"] == "run end" and decided["interval_steps"] == 55
    assert decided["next_step"] == 61  # no periodic save before the end: the final save keeps step 60
    assert not any(s.due(step) for step in range(6, 61))
    summary = checkpoint_interval_summary(as_events([{"event": "checkpoint_interval", **decided}]))
    assert summary is not None and summary.expected_loss_per_failure_s is not None
    assert summary.expected_loss_per_failure_s <= 55 * 0.025 / 2 + 0.001  # at most half the rest of the run
    line = describe(summary)
    assert line is not None and line.startswith(
        "checkpoints: no periodic save before the run's last step (its final save keeps it); Young/Daly's ~"
    )
    assert "is longer than the run; 55 steps (~1.4 s)" in line and "min of training" not in line


def test_a_save_cost_says_where_it_went_and_a_costly_fixed_interval_gets_advice() -> None:
    """Issue 39 (8): "a save costs 0.313 s ... ~172.98 % of training time" beside a stall column of
    0.0, and no advice: the cost was steps slowed beside a background save, counted as training."""
    from hpclaunch.orchestrator.checkpoint_interval import advice

    costly = decision(
        mode="steps",
        interval_steps=5,
        interval_s=0.18,
        save_cost_s=0.313,
        save_stall_s=0.0,
        step_time_s=0.036,
    )
    summary = checkpoint_interval_summary(as_events([costly]))
    line = describe(summary)
    assert line is not None
    assert (
        "a save costs 0.313 s of training: 0.000 s stalled + 0.313 s of steps slowed beside its writer"
        in line
    )
    assert "~173.89% of training time" in line
    said = advice(summary)
    assert (
        said is not None and "save less often: checkpoint.every_steps: auto (here ~every 1865 steps)" in said
    )
    assert advice(checkpoint_interval_summary(as_events([decision()]))) is None  # auto, 1.7 %: nothing to say
