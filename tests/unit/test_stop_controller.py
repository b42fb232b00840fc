"""The stop protocol object: real signals, the stop requests and a fake clock (single process)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from hpclaunch.rank.stop import StopController, StopGroup
from hpclaunch.rundir import RunPaths
from hpclaunch.rundir.cause import Cause
from hpclaunch.rundir.clock import AttemptClock
from hpclaunch.rundir.control import (
    read_request,
    relay_stop,
    take_user_stop,
    user_stop,
    write_relay_stop,
    write_user_stop,
)

pytestmark = pytest.mark.fast


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def clock(end: float, *, fixed: float | None = None, margin: float = 10, save: float = 20) -> AttemptClock:
    return AttemptClock.build(
        start=end - 3600,
        limit_s=3600,
        scheduler_end=end,
        warn_lead_s=300,
        stop_lead_fixed_s=fixed,
        margin_s=margin,
        save_estimate_s=save,
    )


def test_signal_handlers_only_set_the_flag(tmp_path: Path) -> None:
    stop = StopController(paths=RunPaths(tmp_path), attempt="7.0")
    stop.install_signal_handlers()
    try:
        assert stop.check(1, 0.1) is None
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.signals_seen == ["SIGUSR1"]
        assert stop.check(2, 0.1) is Cause.TIMEOUT
        os.kill(os.getpid(), signal.SIGTERM)  # a later, stronger cause wins
        assert stop.check(3, 0.1) is Cause.PREEMPTION
        assert not (tmp_path / "control").exists()  # handlers do no I/O
    finally:
        stop.restore_signal_handlers()
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_requests_are_read_by_rank_zero_only(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path)
    write_user_stop(paths, continue_=False, attempt=None, by="test")
    assert user_stop(paths) is not None and user_stop(paths).cause is Cause.USER  # type: ignore[union-attr]
    assert StopController(paths=paths, attempt="7.0", ranks=StopGroup(rank=0)).check(1, 0.1) is Cause.USER
    assert StopController(paths=paths, attempt="7.0", ranks=StopGroup(rank=1)).check(1, 0.1) is None


def test_relayed_cause_overrides_a_signal_fallback(tmp_path: Path) -> None:
    """The agent relays the real cause; a worker's own signal guess must not override it."""
    paths = RunPaths(tmp_path)
    write_relay_stop(paths, "7.0", Cause.TIMEOUT, by="agent:SIGTERM")
    stop = StopController(paths=paths, attempt="7.0")
    stop.request(Cause.USER)
    assert stop.check(1, 0.1) is Cause.TIMEOUT


def test_a_relay_for_another_attempt_is_never_read(tmp_path: Path) -> None:
    """A node agent that got the requeue's SIGTERM after node 0 decided writes a relay for the
    attempt that is over: the next attempt must not stop after its first step for it."""
    paths = RunPaths(tmp_path)
    write_relay_stop(paths, "7.0", Cause.PREEMPTION, by="agent:SIGTERM")
    assert relay_stop(paths, "7.1") is None
    assert StopController(paths=paths, attempt="7.1").check(1, 0.1) is None
    assert StopController(paths=paths, attempt="7.0").check(1, 0.1) is Cause.PREEMPTION


def test_a_relay_never_overwrites_the_users_request(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path)
    write_user_stop(paths, continue_=False, attempt="7.0", by="hpclaunch stop")
    write_relay_stop(paths, "7.0", Cause.TIMEOUT, by="agent:SIGUSR2")
    write_relay_stop(paths, "7.0", Cause.PREEMPTION, by="agent:SIGTERM")
    user = user_stop(paths)
    assert user is not None and user.cause is Cause.USER and not user.continue_
    relay = relay_stop(paths, "7.0")
    assert relay is not None and relay.cause is Cause.PREEMPTION  # the stronger one is kept
    write_relay_stop(paths, "7.0", Cause.TIMEOUT, by="agent:SIGUSR2")
    assert relay_stop(paths, "7.0").cause is Cause.PREEMPTION  # type: ignore[union-attr]


def test_taking_the_users_request_is_atomic_and_clears_relays(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path)
    write_user_stop(paths, continue_=True, attempt="7.0", by="hpclaunch stop")
    write_relay_stop(paths, "7.0", Cause.TIMEOUT, by="agent")
    taken = take_user_stop(paths, "7.0")
    assert taken is not None and taken.continue_
    assert user_stop(paths) is None and relay_stop(paths, "7.0") is None
    assert take_user_stop(paths, "7.1") is None  # a continue flag never outlives its request


def test_a_torn_request_still_stops_the_run(tmp_path: Path) -> None:
    stop_file = tmp_path / "stop"
    stop_file.write_text("{not json")
    request = read_request(stop_file)
    assert request is not None and request.cause is Cause.USER


def test_a_request_file_of_the_old_format_reads(tmp_path: Path) -> None:
    stop_file = tmp_path / "stop"
    stop_file.write_text('{"cause": "user", "by": "hpclaunch stop", "requested_at": 5.0}')
    request = read_request(stop_file)
    assert request is not None and (request.cause, request.continue_, request.attempt) == (
        Cause.USER,
        False,
        None,
    )


def test_deadline_with_fake_clock_accounts_for_checkpoint_time() -> None:
    now = FakeClock(1000.0)
    stop = StopController(paths=None, clock=clock(1100.0, margin=10, save=20), now=now)
    # lead = 1.5 * 20 + k * step + 10 = 40 s + one step
    assert stop.check(1, 1.0) is None
    now.now = 1058.0
    assert stop.check(2, 1.0) is None
    now.now = 1059.5
    assert stop.check(3, 1.0) is Cause.TIMEOUT
    stop.note_checkpoint_seconds(60.0)  # a slow save seen: the deadline moves earlier
    assert stop.lead_s is not None and stop.lead_s > 90


def test_explicit_stop_lead_is_used_as_is() -> None:
    now = FakeClock(0.0)
    stop = StopController(paths=None, clock=clock(100.0, fixed=30), now=now)
    now.now = 69.0
    assert stop.check(1, 0.5) is None
    now.now = 70.0
    assert stop.check(2, 0.5) is Cause.TIMEOUT


def test_no_clock_no_deadline() -> None:
    stop = StopController(paths=None, now=FakeClock(1e12))
    assert stop.lead_s is None and stop.check(1, 0.5) is None


def test_check_interval_keeps_cost_under_one_percent_and_reaction_bounded() -> None:
    stop = StopController(paths=None, max_reaction_s=2.0)
    stop.check_cost_s = 0.005  # a 5 ms collective
    stop._step_time_s = 0.1  # 100 ms steps -> k = 5 to stay under 1 %
    assert stop._propose_k() == 5
    stop._step_time_s = 0.01  # 10 ms steps: cost bound says 50, reaction bound 200
    assert stop._propose_k() == 50
    stop.check_cost_s = 1.0  # absurdly slow check: reaction bound (2 s) wins
    assert stop._propose_k() == 200


def test_checks_only_happen_every_k_steps() -> None:
    stop = StopController(paths=None)
    stop.k = 3
    stop.next_check = 3
    stop.request(Cause.USER)
    assert stop.check(1, 0.1) is None
    assert stop.check(2, 0.1) is None
    assert stop.check(3, 0.1) is Cause.USER


@pytest.mark.parametrize("cause", [Cause.CRASH, Cause.CANCELLED])
def test_only_stop_causes_are_requests(tmp_path: Path, cause: Cause) -> None:
    path = tmp_path / "stop"
    path.write_text(f'{{"cause": "{cause.value}"}}')
    request = read_request(path)  # unreadable as a request, still a request to stop: the user's
    assert request is not None and request.cause is Cause.USER


def test_a_check_asked_for_at_a_step_agrees_there_however_long_the_interval() -> None:
    """verify-resume's stop (testing.stop_at_step): with 1 ms steps the interval between checks grew
    past the script's end, and the stop never landed; every rank asks for a check at that step."""
    stop = StopController(paths=None)
    stop.next_check = 30  # (a long interval: what tiny steps beside a costly check propose)
    stop.request(Cause.USER)
    assert stop.check(10, 0.001) is None  # not a check step
    stop.check_at(11)
    assert stop.check(11, 0.001) is Cause.USER
