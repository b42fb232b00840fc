"""The stop protocol object: real signals, a control file and a fake clock (single process)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from hpclaunch.jobs.stop import StopCause, StopController, read_stop_request, write_stop_request


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_signal_handlers_only_set_the_flag(tmp_path: Path) -> None:
    stop = StopController(stop_file=tmp_path / "stop")
    stop.install_signal_handlers()
    try:
        assert stop.check(1, 0.1) == StopCause.NONE
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.signals_seen == ["SIGUSR1"]
        assert stop.check(2, 0.1) == StopCause.TIMEOUT
        os.kill(os.getpid(), signal.SIGTERM)  # a later, stronger cause wins
        assert stop.check(3, 0.1) == StopCause.PREEMPTION
        assert not (tmp_path / "stop").exists()  # handlers do no I/O
    finally:
        stop.restore_signal_handlers()
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_control_file_is_read_by_rank_zero_only(tmp_path: Path) -> None:
    stop_file = tmp_path / "control" / "stop"
    write_stop_request(stop_file, "user", by="test")
    assert read_stop_request(stop_file) == StopCause.USER
    assert StopController(stop_file=stop_file, rank=0).check(1, 0.1) == StopCause.USER
    assert StopController(stop_file=stop_file, rank=1).check(1, 0.1) == StopCause.NONE


def test_control_file_cause_overrides_a_signal_fallback(tmp_path: Path) -> None:
    """The agent writes the real cause; a worker's own signal guess must not override it."""
    stop_file = tmp_path / "stop"
    write_stop_request(stop_file, "user", by="agent")
    stop = StopController(stop_file=stop_file)
    stop.request(StopCause.TIMEOUT)
    assert stop.check(1, 0.1) == StopCause.USER


def test_torn_control_file_counts_as_user_stop(tmp_path: Path) -> None:
    stop_file = tmp_path / "stop"
    stop_file.write_text("{not json")
    assert read_stop_request(stop_file) == StopCause.USER


def test_deadline_with_fake_clock_accounts_for_checkpoint_time() -> None:
    clock = FakeClock(1000.0)
    stop = StopController(stop_file=None, end_time=1100.0, margin_s=10, checkpoint_s_estimate=20, clock=clock)
    # lead = 1.5 * 20 + k * step + 10 = 40 s + one step
    assert stop.check(1, 1.0) == StopCause.NONE
    clock.now = 1058.0
    assert stop.check(2, 1.0) == StopCause.NONE
    clock.now = 1059.5
    assert stop.check(3, 1.0) == StopCause.TIMEOUT
    stop.note_checkpoint_seconds(60.0)  # a slow save seen: the deadline moves earlier
    assert stop.lead_s > 90


def test_explicit_stop_lead_is_used_as_is() -> None:
    clock = FakeClock(0.0)
    stop = StopController(stop_file=None, end_time=100.0, stop_lead_s=30, clock=clock)
    clock.now = 69.0
    assert stop.check(1, 0.5) == StopCause.NONE
    clock.now = 70.0
    assert stop.check(2, 0.5) == StopCause.TIMEOUT


def test_check_interval_keeps_cost_under_one_percent_and_reaction_bounded() -> None:
    stop = StopController(stop_file=None, max_reaction_s=2.0)
    stop.check_cost_s = 0.005  # a 5 ms collective
    stop._step_time_s = 0.1  # 100 ms steps -> k = 5 to stay under 1 %
    assert stop._propose_k() == 5
    stop._step_time_s = 0.01  # 10 ms steps: cost bound says 50, reaction bound 200
    assert stop._propose_k() == 50
    stop.check_cost_s = 1.0  # absurdly slow check: reaction bound (2 s) wins
    assert stop._propose_k() == 200


def test_checks_only_happen_every_k_steps() -> None:
    stop = StopController(stop_file=None)
    stop.k = 3
    stop.next_check = 3
    stop.request(StopCause.USER)
    assert stop.check(1, 0.1) == StopCause.NONE
    assert stop.check(2, 0.1) == StopCause.NONE
    assert stop.check(3, 0.1) == StopCause.USER
