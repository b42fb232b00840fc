"""Attempts, causes and goodput from a ledger (pure functions over events)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from hpclaunch.cli.time_view import time_parts
from hpclaunch.orchestrator.status import (
    LOST_AFTER_S,
    attempts_from_events,
    current_job_id,
    run_state,
    step_counts,
    summarize,
)
from hpclaunch.orchestrator.write_failures import describe_failed_saves, failed_saves
from hpclaunch.rundir.events import as_events

pytestmark = pytest.mark.fast

RECORDED = Path(__file__).parent / "recorded" / "requeued_run"


def ev(event: str, attempt: str | None = None, **fields: object) -> dict[str, object]:
    out: dict[str, object] = {"event": event, "ts": 0.0, **fields}
    if attempt:
        out["attempt"] = attempt
    return out


LEDGER = [
    ev("submitted", job_id="7"),
    ev("started", "7.0", job_id="7", restart_count=0, nodes=1, node=0),
    ev("resumed", "7.0", step=0, world_size=2),
    ev("checkpoint_saved", "7.0", step=50),
    ev("stop_requested", "7.0", cause="timeout"),
    ev("stopped", "7.0", cause="timeout", step=63),
    ev("checkpoint_saved", "7.0", step=63),
    ev("requeued", "7.0", cause="timeout", by="agent"),
    ev("started", "7.1", job_id="7", restart_count=1, nodes=1, node=0),
    ev("resumed", "7.1", step=63, world_size=2),
    ev("stopped", "7.1", cause="preemption", step=120),
    ev("requeued", "7.1", cause="preemption", by="scheduler"),
    ev("started", "7.2", job_id="7", restart_count=2, nodes=1, node=0),
    ev("resumed", "7.2", step=120, world_size=4),
    ev("finished", "7.2", step=200),
]


def test_attempts_keep_their_causes() -> None:
    attempts = attempts_from_events(as_events(LEDGER))
    assert [(a.attempt, a.end, a.cause) for a in attempts] == [
        ("7.0", "requeued", "timeout"),
        ("7.1", "requeued", "preemption"),
        ("7.2", "finished", None),
    ]
    assert [(a.resumed_step, a.last_step) for a in attempts] == [(0, 63), (63, 120), (120, 200)]
    assert attempts[2].world_size == 4


def test_exact_resume_has_full_goodput() -> None:
    gp = step_counts(attempts_from_events(as_events(LEDGER)))
    assert (gp.useful_steps, gp.computed_steps, gp.repeated_steps, gp.lost_steps, gp.kept_ratio) == (
        200,
        200,
        0,
        0,
        1.0,
    )


def test_resume_from_an_older_checkpoint_repeats_steps() -> None:
    events = [
        ev("started", "1.0", node=0),
        ev("resumed", "1.0", step=0),
        ev("checkpoint_saved", "1.0", step=50),
        ev("failed", "1.0", cause="crash"),
        ev("started", "1.1", node=0),
        ev("resumed", "1.1", step=50),
        ev("finished", "1.1", step=100),
    ]
    # The crashed attempt is only known to have reached its checkpoint; a stop at 63 would show 13 repeated.
    events.insert(3, ev("stopped", "1.0", step=63, cause="user"))
    gp = step_counts(attempts_from_events(as_events(events)))
    assert gp.repeated_steps == 13 and gp.computed_steps == 113 and gp.lost_steps == 0
    assert gp.kept_ratio == round(100 / 113, 4)


def test_a_crash_decided_at_a_step_no_line_logged_counts_that_step_computed_not_lost() -> None:
    """A script logs when it likes (every 10 steps here); its crash at step 8 was decided with the
    step its ranks reached, and the restart in place resumed from the memory tier's step 6: 2 steps
    repeated, none lost (status said 6 lost, reading the attempt's end as step 0)."""
    events = [
        ev("started", "1.0", node=0),
        ev("resumed", "1.0", step=0),
        ev("requeued", "1.0", cause="crash", step=8, in_place=True, by="agent"),
        ev("started", "1.0.1", node=0, in_place=True),
        ev("resumed", "1.0.1", step=6, tier="memory"),
        ev("finished", "1.0.1", step=70),
    ]
    attempts = attempts_from_events(as_events(events))
    assert [(a.resumed_step, a.last_step) for a in attempts] == [(0, 8), (6, 70)]
    gp = step_counts(attempts)
    assert (gp.useful_steps, gp.repeated_steps, gp.lost_steps) == (70, 2, 0)


def test_run_state_and_current_job() -> None:
    attempts = attempts_from_events(as_events(LEDGER))
    assert run_state(attempts, as_events(LEDGER), "completed") == "finished"
    assert run_state(attempts[:1], as_events(LEDGER), "running") == "requeued"
    pbs = [ev("submitted", job_id="10"), ev("requeued", "10.0", job_id="11", cause="timeout")]
    assert current_job_id(as_events(pbs)) == "11"
    assert run_state([], as_events([ev("submitted", job_id="1")]), "pending") == "pending"


def test_a_continuation_that_never_comes_is_lost_after_a_grace_period() -> None:
    ledger = [*LEDGER[:8]]
    ledger[7] = {**ledger[7], "ts": 1000.0, "job_id": "8.pbshead"}
    attempts = attempts_from_events(as_events(ledger))
    # the scheduler still shows it pending: requeued
    assert run_state(attempts, as_events(ledger), "pending", now=5000.0) == "requeued"
    # the scheduler shows nothing active, but only for a moment: still requeued
    assert run_state(attempts, as_events(ledger), "completed", now=1030.0) == "requeued"
    # ... for longer than the grace period: lost (and `submit --wait` stops waiting)
    assert run_state(attempts, as_events(ledger), "unknown", now=1000.0 + LOST_AFTER_S + 1) == "lost"
    # the continuation was cancelled while it waited in the queue: cancelled, as the user said
    assert run_state(attempts, as_events(ledger), "cancelled", now=1000.0 + LOST_AFTER_S + 1) == "cancelled"
    assert current_job_id(as_events(ledger)) == "8.pbshead"


def test_a_submission_that_never_starts_is_lost_too() -> None:
    ledger = [{"event": "submitted", "ts": 100.0, "job_id": "5"}]
    assert run_state([], as_events(ledger), "pending", now=9999.0) == "pending"
    assert run_state([], as_events(ledger), "failed", now=100.0 + LOST_AFTER_S + 1) == "lost"
    # a pending job the user cancelled (scancel, qdel): the run ended as they said, not lost
    assert run_state([], as_events(ledger), "cancelled", now=100.0 + LOST_AFTER_S + 1) == "cancelled"
    assert run_state([], as_events(ledger), "cancelled", now=101.0) == "pending"  # the grace period first


def test_a_resume_submitted_after_the_run_finished_is_pending_not_the_old_attempts_end() -> None:
    """`submit --resume` after a finish: until its attempt starts, the run waits for the new job (a
    `stop` then is for it); the finished attempt's job still exiting would read "finishing"."""
    ledger = [
        *LEDGER,
        ev("submitting", resume=True),
        {**ev("submitted", job_id="9", resume=True), "ts": 500.0},
    ]
    attempts = attempts_from_events(as_events(ledger))
    assert run_state(attempts, as_events(ledger), "running", now=501.0) == "pending"
    assert run_state(attempts, as_events(ledger), "pending", now=501.0) == "pending"
    assert run_state(attempts, as_events(ledger), "failed", now=500.0 + LOST_AFTER_S + 1) == "lost"
    # its attempt has started, even before `submit` recorded the job's id: that attempt's state
    started = [*LEDGER, ev("submitting", resume=True), ev("started", "9.0", job_id="9", node=0)]
    started.append(ev("submitted", job_id="9", resume=True))
    attempts = attempts_from_events(as_events(started))
    assert run_state(attempts, as_events(started), "running") == "running"
    # the run's own first submission is no resume: finished stays finished
    assert run_state(attempts_from_events(as_events(LEDGER)), as_events(LEDGER), "running") == "finishing"


def test_withdrawn_and_user_ended_attempts() -> None:
    ledger = [
        ev("submitted", job_id="7"),
        ev("started", "7.0", job_id="7", node=0),
        ev("stopped", "7.0", cause="user", step=10),
        ev("ended", "7.0", cause="user"),
        ev("started", "7.1", job_id="7", node=0),
        ev("held", "7.1", reason="the run had already ended (ended)"),
    ]
    attempts = attempts_from_events(as_events(ledger))
    assert [(a.end, a.cause) for a in attempts] == [("stopped", "user"), ("withdrawn", None)]


def test_a_failed_and_retried_save_is_shown_per_attempt_and_for_the_run() -> None:
    """Issue 26: a background save killed by a signal (then saved again, blocking) left no trace in
    status; it now shows in the attempt's row and one line for the run."""
    failed = ev(
        "checkpoint_failed",
        "7.0",
        step=14,
        error="the checkpoint writer process of rank 0 (pid 9) died (killed by SIGUSR2)",
        action="blocking retry",
    )
    ledger = [*LEDGER[:4], failed, *LEDGER[4:]]
    attempts = attempts_from_events(as_events(ledger))
    assert [a.failed_saves for a in attempts] == [1, 0, 0]
    summary = failed_saves(as_events(ledger))
    assert summary is not None and summary.count == 1 and summary.last.step == 14
    line = describe_failed_saves(summary)
    assert line == (
        "checkpoint: 1 save failed; the last at step 14 (blocking retry): the checkpoint writer "
        "process of rank 0 (pid 9) died (killed by SIGUSR2)"
    )
    assert failed_saves(as_events(LEDGER)) is None and describe_failed_saves(None) is None


def test_status_json_goodput_is_the_time_share_the_text_shows(tmp_path: Path) -> None:
    """Issue 26: `status --json` -> goodput was the step ratio (1.0) while the text's goodput was the
    time share (66.4 %). Now goodput is the time share everywhere; the steps are step_counts."""
    run = tmp_path / "run"
    shutil.copytree(RECORDED, run)
    status = summarize(run, scheduler_status=None)
    view = status.to_json()
    assert isinstance(view["goodput"], float) and 0 < view["goodput"] < 1
    assert view["goodput"] == pytest.approx(view["time"]["goodput"], abs=1e-4)
    counts = view["step_counts"]
    assert counts["kept_ratio"] == 1.0 and counts["useful_steps"] == view["step"]
    lines = [str(part) for part in time_parts(status)]
    assert any(f"goodput {view['goodput']:.1%}" in line for line in lines)
    assert any("steps: " in line and "(100.0%)" in line for line in lines)
