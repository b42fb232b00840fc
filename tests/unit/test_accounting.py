"""Where a run's time went (orchestrator.accounting): synthetic ledgers with known answers."""

from __future__ import annotations

import itertools

import pytest

from hpclaunch.orchestrator.accounting import PHASES, RunTime, account, fmt_seconds
from hpclaunch.orchestrator.status import attempts_from_events, step_counts
from hpclaunch.rundir.events import as_events
from hpclaunch.rundir.metrics import MetricsLine
from hpclaunch.rundir.progress_files import ProgressRecord

pytestmark = pytest.mark.fast


def ev(event: str, ts: float, attempt: str | None = None, **fields: object) -> dict[str, object]:
    out: dict[str, object] = {"event": event, "ts": ts, **fields}
    if attempt:
        out["attempt"] = attempt
    return out


def line(step: int, ts: float, attempt: str, step_time: float = 1.0) -> dict[str, object]:
    return {"step": step, "ts": ts, "attempt": attempt, "step_time_s": step_time, "loss": 1.0}


LIMIT = 60.0
# Attempt 7.0: stopped by its deadline at step 30 after an async save at 20; the trainer reports
# its start-up parts (issue 10's fields). Attempt 7.1: resumed at 30, saved at 50, crashed at 62.
# Attempt 7.2: resumed at 50 and finished at 70.
EVENTS = [
    ev("submitted", 100.0, job_id="7"),
    ev("started", 101.0, "7.0", node=0, end_time=100.5 + LIMIT),
    ev("node_preflight", 102.0, "7.0", node=0, ok=True),
    ev(
        "resumed",
        110.0,
        "7.0",
        step=0,
        process_start=103.0,
        startup_s={"imports": 2.0, "distributed": 1.0, "smoke": 0.5, "data": 1.0, "model": 0.5, "load": 0.2},
    ),
    ev("checkpoint_saved", 133.0, "7.0", step=20, blocking=False, stall_s=0.5, seconds=3.0),
    ev("stop_requested", 139.0, "7.0", cause="timeout"),
    ev("checkpoint_saved", 143.0, "7.0", step=30, blocking=True, stall_s=2.5, seconds=2.4),
    ev("stopped", 143.1, "7.0", cause="timeout", step=30),
    ev("requeued", 144.0, "7.0", cause="timeout"),
    ev("started", 146.0, "7.1", node=0, end_time=145.5 + LIMIT),
    ev("resumed", 150.0, "7.1", step=30),
    ev("checkpoint_saved", 172.0, "7.1", step=50, blocking=False, stall_s=0.2, seconds=1.5),
    ev("requeued", 190.0, "7.1", cause="crash"),
    ev("started", 191.0, "7.2", node=0, end_time=190.5 + LIMIT),
    ev("resumed", 195.0, "7.2", step=50),
    ev("checkpoint_saved", 217.0, "7.2", step=70, blocking=True, stall_s=1.0, seconds=1.0),
    ev("finished", 218.0, "7.2", step=70),
]
METRICS = [
    line(10, 120.0, "7.0"),
    line(20, 130.0, "7.0"),
    line(30, 140.5, "7.0"),
    line(40, 160.0, "7.1"),
    line(50, 170.0, "7.1"),
    line(60, 180.2, "7.1"),
    line(60, 205.0, "7.2"),
    line(70, 215.0, "7.2"),
]
# rank 0 was computing step 63 when the crash came: 62 is its last completed step
PROGRESS = {
    "7.1": ProgressRecord.from_json(
        {"rank": 0, "step": 63, "phase": "compute", "last_step_s": 1.0, "updated": 183.0}
    )
}


def as_lines(records: list[dict]) -> list[MetricsLine]:
    return [MetricsLine.from_json(r) for r in records]


@pytest.fixture
def run() -> RunTime:
    return account(as_events(EVENTS), as_lines(METRICS), time_limit_s=LIMIT, progress=PROGRESS, now=1000.0)


def test_a_stopped_attempt_splits_into_startup_training_stall_end_save_idle(run: RunTime) -> None:
    a = run.attempts[0]
    assert a.queue_s == pytest.approx(0.5)  # submitted at 100, the scheduler started it at 100.5
    assert a.allocated_s == pytest.approx(144.0 - 100.5)
    assert a.startup_s == pytest.approx(110.0 - 100.5)
    assert a.stall_s == pytest.approx(0.5) and a.saves == 1
    assert a.training_s == pytest.approx(140.5 - 110.0 - 0.5)
    assert (a.lost_s, a.lost_steps, a.kept_step) == (0.0, 0, 30)
    assert a.end_save_s == pytest.approx(143.1 - 140.5)
    assert a.idle_s == pytest.approx(144.0 - 143.1)
    assert a.goodput == pytest.approx(30.0 / 43.5)


def test_the_trainers_own_startup_parts_are_used_when_reported(run: RunTime) -> None:
    parts = run.attempts[0].startup_parts
    assert parts["scheduler"] == pytest.approx(0.5)  # allocation start -> agent started
    assert parts["node_checks"] == pytest.approx(1.0)
    assert parts["launch"] == pytest.approx(1.0)  # node checks done -> the rank's process started
    assert (parts["imports"], parts["smoke"], parts["load"]) == (2.0, 0.5, 0.2)
    assert parts["other"] == pytest.approx(7.0 - 5.2)
    assert sum(parts.values()) == pytest.approx(run.attempts[0].startup_s)


def test_without_them_startup_is_one_trainer_part(run: RunTime) -> None:
    parts = run.attempts[1].startup_parts
    assert parts == pytest.approx({"scheduler": 0.5, "trainer": 4.0})


def test_a_crash_loses_the_steps_after_its_last_checkpoint_and_their_time(run: RunTime) -> None:
    a = run.attempts[1]
    assert a.queue_s == pytest.approx(1.5)  # requeued at 144, the scheduler started it at 145.5
    assert (a.first_step, a.kept_step, a.last_step, a.lost_steps) == (30, 50, 62, 12)
    # step 50 ended at 170, its save stalled 0.2 s, then steps 51..62 ran until 180.2 + 2 x 1.0
    assert a.stall_s == pytest.approx(0.2)
    assert a.training_s == pytest.approx(170.0 - 150.0)
    assert a.lost_s == pytest.approx(182.2 - 170.2)
    assert a.end_save_s == 0.0
    assert a.idle_s == pytest.approx(190.0 - 182.2)
    assert any("61-62" in note for note in a.estimated)


def test_a_step_the_decision_recorded_past_rank_0s_progress_is_lost_too_as_status_counts_it() -> None:
    """Rank 0 killed inside step 63 (its record: computing 63), another rank completed 63 and
    failed in 64: the decision records step 63. The time figures count 13 lost steps, the step
    figures 13 repeated (they once disagreed by one: 12 against 13)."""
    events = [dict(e) for e in EVENTS]
    crash = next(i for i, e in enumerate(events) if e["event"] == "requeued" and e["attempt"] == "7.1")
    events[crash] = {**events[crash], "step": 63}
    t = account(as_events(events), as_lines(METRICS), time_limit_s=LIMIT, progress=PROGRESS, now=1000.0)
    a = t.attempts[1]
    assert (a.kept_step, a.last_step, a.lost_steps) == (50, 63, 13)
    assert any("61-63" in note for note in a.estimated)
    counts = step_counts(attempts_from_events(as_events(events)))
    assert counts.repeated_steps == a.lost_steps


def test_a_finished_attempts_final_save_is_its_end_save_not_a_stall(run: RunTime) -> None:
    a = run.attempts[2]
    assert a.stall_s == 0.0 and a.lost_steps == 0
    assert a.end_save_s == pytest.approx(217.0 - 215.0)
    assert a.training_s == pytest.approx(215.0 - 195.0)


def test_phases_add_up_and_the_run_goodput_is_kept_training_over_allocated(run: RunTime) -> None:
    for a in run.attempts:
        allocated = sum(v for k, v in a.phase_seconds().items() if k != "queue")
        assert allocated == pytest.approx(a.allocated_s)
        spans = [s for s in a.segments if s.phase != "queue"]
        assert all(x.end == pytest.approx(y.start) for x, y in itertools.pairwise(spans))
    r = run
    assert r.lost_steps == 12
    assert r.goodput == pytest.approx(r.training_s / r.allocated_s)
    assert r.queue_s == pytest.approx(0.5 + 1.5 + 0.5)
    json_view = r.to_json()
    assert set(PHASES) <= {k[:-2] for k in json_view if k.endswith("_s")}
    assert json_view["attempts"][1]["segments"][0][0] == "queue"


def test_a_resume_from_an_older_checkpoint_loses_the_newer_one_too() -> None:
    # 7.1 saved 50 but 7.2 resumed from 40 (the newer checkpoint was unusable): 41..62 are lost
    events = [e for e in EVENTS if not (e.get("attempt") == "7.2" and e["event"] == "resumed")]
    events.insert(-2, ev("resumed", 195.0, "7.2", step=40))
    events.insert(12, ev("checkpoint_saved", 162.0, "7.1", step=40, blocking=False, stall_s=0.1))
    a = account(
        as_events(events), as_lines(METRICS), time_limit_s=LIMIT, progress=PROGRESS, now=1000.0
    ).attempts[1]
    assert (a.kept_step, a.lost_steps) == (40, 22)


def test_a_checkpoint_saved_but_never_recorded_counts_as_kept_where_the_next_attempt_resumed_from_it() -> (
    None
):
    """7.1's ranks died before they recorded their step-50 save's end (a background save, then the
    crash): 7.2 resumed from it, so 7.1 kept 50 and lost 51..62 (status said "lost 20 steps after its
    last checkpoint (step 30)" beside "resumed from step 50")."""
    events = [e for e in EVENTS if not (e.get("attempt") == "7.1" and e["event"] == "checkpoint_saved")]
    a = account(
        as_events(events), as_lines(METRICS), time_limit_s=LIMIT, progress=PROGRESS, now=1000.0
    ).attempts[1]
    assert (a.kept_step, a.last_step, a.lost_steps) == (50, 62, 12)
    rows = attempts_from_events(as_events(events))
    assert rows[1].checkpoint_step == 50 and rows[0].checkpoint_step == 30


def test_a_live_attempt_has_no_lost_steps_yet_and_ends_now() -> None:
    events = [e for e in EVENTS if float(e["ts"]) <= 175.0]
    metrics = [m for m in METRICS if float(m["ts"]) <= 175.0]
    r = account(as_events(events), as_lines(metrics), time_limit_s=LIMIT, live=True, now=175.0)
    a = r.attempts[-1]
    assert a.running and a.lost_steps == 0 and a.last_step == 50
    assert a.allocated_s == pytest.approx(175.0 - 145.5)
    assert a.training_s + a.stall_s == pytest.approx(170.2 - 150.0)


def test_an_attempt_whose_agent_died_ends_at_its_last_sign_of_life() -> None:
    events = [e for e in EVENTS if not (e.get("attempt") == "7.1" and e["event"] == "requeued")]
    a = account(
        as_events(events), as_lines(METRICS), time_limit_s=LIMIT, progress=PROGRESS, now=1000.0
    ).attempts[1]
    assert a.allocated_s == pytest.approx(183.0 - 145.5)  # the progress file's last beat


def test_metrics_without_an_attempt_key_are_placed_by_time_and_no_end_time_means_agent_start() -> None:
    metrics = [{k: v for k, v in m.items() if k != "attempt"} for m in METRICS]
    events = [{k: v for k, v in e.items() if k != "end_time"} for e in EVENTS]
    r = account(as_events(events), as_lines(metrics), time_limit_s=None, progress=PROGRESS, now=1000.0)
    assert [a.last_step for a in r.attempts] == [30, 62, 70]
    assert r.attempts[0].startup_s == pytest.approx(110.0 - 101.0)
    assert r.attempts[0].queue_s == pytest.approx(1.0)


def test_an_attempt_that_never_resumed_is_all_startup() -> None:
    events = [
        ev("submitted", 0.0),
        ev("started", 1.0, "1.0", node=0),
        ev("failed", 9.0, "1.0", cause="crash"),
    ]
    a = account(as_events(events), [], now=50.0).attempts[0]
    assert a.startup_s == pytest.approx(8.0) and a.training_s == 0.0 and a.goodput == 0.0
    assert a.kept_step is None


def test_seconds_read_at_a_glance() -> None:
    assert [fmt_seconds(x) for x in (None, 4.25, 185.0, 7440.0)] == ["-", "4.2 s", "3 min 05 s", "2 h 04 min"]
