"""Issue 24, pure and file-level parts: liveness by observation, a slow node that is not dead, the
decider as a role of the roster (takeover during the checks, the watchdog led by whoever decides),
health between attempts (a crash pinned on a node, a check that fails, no restart loop).

Each test states which finding it covers; each fails on the code before the fix."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from hpclaunch.config import RunConfig
from hpclaunch.jobs import allocation
from hpclaunch.jobs.allocation import DEAD_AFTER_S, Allocation, Roster, await_reports
from hpclaunch.jobs.attribution import suspect
from hpclaunch.jobs.decision_rules import Action, Budgets, Facts, History, decide
from hpclaunch.jobs.node_checks import NodeVerdict, StartBarrier, run_checks
from hpclaunch.jobs.watchdog import Watchdog, Watched, read_verdict
from hpclaunch.orchestrator.plan_build import build
from hpclaunch.rundir import AttemptOutcome, Ledger, RunPaths, read_events
from hpclaunch.rundir.cause import Cause
from hpclaunch.rundir.events import as_events
from hpclaunch.rundir.paths import newest_checkpoint_step
from hpclaunch.rundir.progress_files import progress_file
from hpclaunch.schedulers.protocol import NodeContext

pytestmark = pytest.mark.fast

BUDGETS = Budgets(max_requeues=3, max_failure_retries=1, max_node_excludes=2, max_hang_retries=3)
HOSTS = ("n1", "n2", "n3")


class Clock:
    """A monotonic clock the test moves (the observer's own clock)."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s


def alloc(tmp_path: Path, host: str, clock: Clock | None = None) -> Allocation:
    paths = RunPaths(tmp_path).ensure()
    a = Allocation(paths, "7.0", host, HOSTS, clock=clock or Clock())
    a.beats.mkdir(parents=True, exist_ok=True)
    return a


# ---- finding 5: liveness by observation -------------------------------------------------------


def test_a_heartbeat_that_changes_is_alive_whatever_its_files_mtime_says(tmp_path: Path) -> None:
    """NFS attribute caching and clock skew: an mtime hours in the past (or the future) says nothing;
    the counter changing, seen on the observer's own clock, does."""
    clock = Clock()
    n1, observer = alloc(tmp_path, "n1"), alloc(tmp_path, "n2", clock)
    n1.beat()
    os.utime(n1.beats / "n1", (1.0, 1.0))  # an mtime from 1970: the old rule called this dead
    assert observer.alive("n1")
    clock.sleep(DEAD_AFTER_S - 1)
    n1.beat()
    os.utime(n1.beats / "n1", (1.0, 1.0))
    clock.sleep(DEAD_AFTER_S - 1)  # 2 x (T - 1) since the first look, but it changed in between
    assert observer.alive("n1")


def test_a_heartbeat_that_stops_changing_is_dead_after_the_window_even_with_a_future_mtime(
    tmp_path: Path,
) -> None:
    clock = Clock()
    n1, observer = alloc(tmp_path, "n1"), alloc(tmp_path, "n2", clock)
    n1.beat()
    future = time.time() + 3600  # a skewed clock on n1: the old rule called this alive for an hour
    os.utime(n1.beats / "n1", (future, future))
    assert observer.alive("n1")  # first look: given the whole window
    clock.sleep(DEAD_AFTER_S - 0.5)
    assert observer.alive("n1")
    clock.sleep(1.0)
    assert not observer.alive("n1")
    n1.beat()  # it beats again (a restarted agent, a filesystem back): alive again
    assert observer.alive("n1")


def test_a_host_not_beating_yet_is_starting_for_the_start_grace_then_gone(tmp_path: Path) -> None:
    """CI (PBS, mpiexec): pbsn2's agent started 0.4 s after pbsn1's, and pbsn1 called it gone at
    the first look (no heartbeat file yet): the run failed before its first step."""
    clock = Clock()
    observer = alloc(tmp_path, "n1", clock)
    assert observer.alive("n2")  # first look, no file: starting
    assert observer.decider(Roster(("n2", "n1"), ())) == "n2"  # a late node 0 keeps its role
    clock.sleep(allocation.START_GRACE_S - 1)
    assert observer.alive("n2")
    alloc(tmp_path, "n2").beat()  # it starts: beating, given the usual window from here
    assert observer.alive("n2")
    clock.sleep(DEAD_AFTER_S - 1)
    assert observer.alive("n2")
    clock.sleep(2)
    assert not observer.alive("n2")
    assert observer.alive("n3")
    clock.sleep(allocation.START_GRACE_S + 0.1)
    assert not observer.alive("n3")  # never started: gone after the grace
    assert observer.decider(Roster(("n3", "n1"), ())) == "n1"


def test_the_beat_is_rewritten_in_place_at_a_fixed_width(tmp_path: Path) -> None:
    n1 = alloc(tmp_path, "n1")
    for _ in range(12):
        n1.beat()
    text = (n1.beats / "n1").read_text()
    assert len(text) == allocation.BEAT_WIDTH and text.split() == [str(os.getpid()), "12"]


# ---- finding 3: a live but slow node is not dead ------------------------------------------------


def test_a_beating_node_that_has_not_reported_is_stuck_not_dead(tmp_path: Path) -> None:
    """The old rule returned every silent node as dead after 60 s, beating or not: a node budget
    spent and a healthy node replaced. Now it is a hang (its own budget), and only after the attempt
    was seen over somewhere."""
    clock = Clock()
    decider = alloc(tmp_path, "n1", clock)
    n2 = alloc(tmp_path, "n2")
    n2.beat()
    decider.report("7.0", 0, {"state": "failed"})  # n1's ranks ended the attempt
    beats = iter(range(10_000))

    def poll() -> None:  # n2's agent beats all along (its ranks are in D-state)
        next(beats)
        n2.beat()

    dead, stuck = await_reports(decider, "7.0", {0: "n1", 1: "n2"}, clock=clock, sleep=clock.sleep, poll=poll)
    assert (dead, stuck) == ((), ("n2",))
    assert clock.t - 1000.0 >= allocation.REPORT_GRACE_S


def test_a_silent_node_whose_beat_stopped_is_dead_within_the_window(tmp_path: Path) -> None:
    clock = Clock()
    decider = alloc(tmp_path, "n1", clock)
    alloc(tmp_path, "n2").beat()  # one beat, then nothing: the node died
    decider.report("7.0", 0, {"state": "failed"})
    dead, stuck = await_reports(decider, "7.0", {0: "n1", 1: "n2"}, clock=clock, sleep=clock.sleep)
    assert (dead, stuck) == (("n2",), ())
    assert clock.t - 1000.0 <= DEAD_AFTER_S + 2 * allocation.BEAT_S


def test_the_decider_waits_as_long_as_the_attempt_runs(tmp_path: Path) -> None:
    """A decider that does not train (node 0 replaced by a spare) waits for the attempt, not 60 s:
    the old rule declared every training node dead 60 s after the decider began to wait."""
    clock = Clock()
    decider = alloc(tmp_path, "n1", clock)
    n2, n3 = alloc(tmp_path, "n2"), alloc(tmp_path, "n3")
    n2.beat()
    n3.beat()
    polls = 0

    def poll() -> None:
        nonlocal polls
        polls += 1
        n2.beat()
        n3.beat()
        if polls == 2000:  # 400 s of training, then both report
            n2.report("7.0", 1, {"state": "succeeded"})
            n3.report("7.0", 2, {"state": "succeeded"})

    assert await_reports(decider, "7.0", {1: "n2", 2: "n3"}, clock=clock, sleep=clock.sleep, poll=poll) == (
        (),
        (),
    )
    assert polls == 2000


# ---- finding 2: the decider is a role of the roster ---------------------------------------------


def test_the_decider_is_the_first_live_node_of_the_roster_not_node_0(tmp_path: Path) -> None:
    """Node 0 (n1) replaced by the spare n3: n3 decides (and leads the watchdog), although n1's agent
    still beats; when n3 dies, n2 takes over. The old rule kept n1 deciding (allocation order)."""
    clock = Clock()
    observer = alloc(tmp_path, "n2", clock)
    for host in HOSTS:
        alloc(tmp_path, host).beat()
    start = Roster(("n1", "n2"), ("n3",))
    assert observer.decider(start) == "n1"
    after = start.replaced([("n1", "n3")])
    assert after == Roster(("n3", "n2"), ())
    assert observer.decider(after) == "n3"
    clock.sleep(DEAD_AFTER_S + 1)
    alloc(tmp_path, "n1").beat()  # n1 still beats, n3 stopped
    assert observer.decider(after) == "n2"


def test_a_waiting_node_takes_over_when_the_decider_dies_during_the_checks(tmp_path: Path) -> None:
    """The old wait_go waited an hour for a go that a dead node 0 would never write."""
    paths = RunPaths(tmp_path).ensure()
    barrier = StartBarrier(paths, "7.0")
    word = barrier.wait_go(timeout_s=3600, take_over=lambda: True)
    assert word.take_over and not word.go
    barrier.announce(go=True, roster=Roster(("n2", "n3")).to_json())
    word = barrier.wait_go(timeout_s=3600, take_over=lambda: True)
    assert word.go and word.roster == {"training": ["n2", "n3"], "spares": []}


def test_the_taker_over_counts_a_dead_node_0_as_failed_even_if_it_had_reported(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path).ensure()
    barrier = StartBarrier(paths, "7.0")
    barrier.report(NodeVerdict(0, "n1", True))  # n1 reported, then died
    barrier.report(NodeVerdict(1, "n2", True))
    verdicts = barrier.gather({0: "n1", 1: "n2", 2: "n3"}, timeout_s=60, gone=lambda h: h in ("n1", "n3"))
    assert set(verdicts.failed_nodes) == {"n1", "n3"}
    assert "agent is gone" in verdicts.failed_nodes["n1"]
    assert Roster(("n1", "n2"), ("n3",)).without(verdicts.failed_nodes) == Roster(("n1", "n2"), ())


def _progress(paths: RunPaths, rank: int, node: str, phase: str, step: int, since: float) -> None:
    path = progress_file(paths, "j.0", rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"rank": rank, "node": node, "pid": None, "step": step, "phase": phase, "phase_since": since}
    path.write_text(json.dumps({**record, "updated": since, "last_step_s": 0.2}))


def test_the_watchdog_is_led_by_the_decider_on_any_node(tmp_path: Path) -> None:
    """After node 0 left the roster the hang was never judged (only node 0's watchdog judged)."""
    from hpclaunch.config import WatchdogConfig

    cfg = WatchdogConfig(
        launch_s=300, startup_s=120, checkpoint_s=600, step_min_s=60, step_factor=10, poll_s=1
    )
    paths = RunPaths(tmp_path).ensure()
    ctx = NodeContext("local", "j", 2, 3, "n3", HOSTS)  # the spare that took n1's place
    dog = Watchdog(
        cfg, paths, ctx, Ledger(paths, role="agent", node=2), Watched(world_size=2), launched_at=0.0
    )
    assert not dog.lead
    dog.ack_nodes = [2, 1]
    dog.lead = True  # the role came to this agent
    _progress(paths, 0, "n3", "collective", 12, 100.0)
    _progress(paths, 1, "n2", "data", 12, 100.0)
    assert dog.check(lambda: [], now=101.0) is None
    (paths.attempt_dir("j.0") / "hang.node1.json").write_text("{}")  # n2 has dumped its ranks
    verdict = dog.check(lambda: [], now=170.0)
    assert verdict is not None and verdict.culprit_node == "n2"
    assert read_verdict(paths, "j.0") == verdict
    assert read_events(paths).named("hang")[0].record["culprit_node"] == "n2"


# ---- finding 1: health between attempts ---------------------------------------------------------


def test_a_named_hosts_check_fails_from_the_attempt_the_knob_says(tmp_path: Path) -> None:
    cfg = RunConfig.model_validate(
        {
            "preflight": {"node_checks": False},
            "testing": {"fail_node_check": {"host": "n2", "from_in_place": 1}},
        }
    )
    first = NodeContext("slurm", "7", 1, 3, "n2", HOSTS)
    later = NodeContext("slurm", "7", 1, 3, "n2", HOSTS, in_place=1)
    other = NodeContext("slurm", "7", 0, 3, "n1", HOSTS, in_place=1)
    plan = build(cfg, python="python3")
    assert run_checks(plan, cfg, first)[0].ok and run_checks(plan, cfg, other)[0].ok
    verdict, rows = run_checks(plan, cfg, later)
    assert not verdict.ok and verdict.check == "gpu" and "ECC" in (verdict.finding or "")
    assert rows and rows[0]["status"] == "fail"


def _reports(**failures: dict[str, int]) -> dict[int, dict[str, Any]]:
    return {i: {"host": h, "state": "failed", "failures": f} for i, (h, f) in enumerate(failures.items())}


def test_gpu_fault_text_in_one_nodes_log_pins_the_crash_on_it(tmp_path: Path) -> None:
    logs = {h: tmp_path / f"{h}.log" for h in ("n1", "n2")}
    logs["n1"].write_text("RuntimeError: Connection closed by peer [10.0.0.2]:1234\n")
    logs["n2"].write_text("x" * 300_000 + "\nRuntimeError: CUDA error: uncorrectable ECC error encountered\n")
    found = suspect(_reports(n1={"0": 1, "1": -15}, n2={"2": 1, "3": 1}), logs)
    assert found is not None and found.node == "n2" and found.certain and "ECC" in found.evidence


def test_ranks_killed_on_one_node_are_a_hint_and_the_stopped_ones_are_not(tmp_path: Path) -> None:
    logs = {h: tmp_path / f"{h}.log" for h in ("n1", "n2")}
    hinted = suspect(_reports(n1={"0": 1, "1": 1}, n2={"2": -9, "3": -15}), logs)
    assert hinted is not None and (hinted.node, hinted.certain) == ("n2", False)
    assert "signal 9" in hinted.evidence
    reports = _reports(n1={"0": -9}, n2={"2": -9})
    assert suspect(reports, logs) is None  # both: names no one
    reports[0]["stopped_by_agent"] = True  # n1's ranks were ended by their agent: n2 is the one
    assert suspect(reports, logs) is not None and suspect(reports, logs).node == "n2"  # type: ignore[union-attr]


CRASH = AttemptOutcome("failed", "crash", 17, "rank 2 on n2: RuntimeError")


def test_a_crash_pinned_on_a_node_by_gpu_text_puts_the_spare_in_its_place_at_once() -> None:
    """The old decision restarted in place on the same node (replace=()), then failed."""
    facts = Facts(
        CRASH,
        suspect="n2",
        suspect_evidence="its ranks reported a GPU fault (CUDA error)",
        suspect_certain=True,
        spares=("n3",),
        in_place_ok=True,
    )
    d = decide(facts, History(), BUDGETS, can_exclude_nodes=True)
    assert (d.action, d.in_place, d.replace, d.counts_as) == (Action.CONTINUE, True, (("n2", "n3"),), "node")
    assert d.cause is Cause.CRASH and "n3 taking the place of n2" in d.reason and d.suspect == "n2"
    # no spare left: a new job without it (SLURM), never the same node again
    d = decide(
        facts.__class__(**{**facts.__dict__, "spares": ()}), History(), BUDGETS, can_exclude_nodes=True
    )
    assert (d.action, d.exclude) == (Action.EXCLUDE, ("n2",))


def test_a_hinted_node_restarts_in_place_once_and_is_evicted_the_second_time() -> None:
    facts = Facts(
        CRASH, suspect="n2", suspect_evidence="its ranks died first", spares=("n3",), in_place_ok=True
    )
    first = decide(facts, History(), BUDGETS, can_exclude_nodes=True)
    assert (first.action, first.in_place, first.replace, first.suspect) == (Action.CONTINUE, True, (), "n2")
    # the ledger remembers the hint (the requeued event's `suspect`)
    events = [
        {"event": "requeued", "cause": "crash", "counts_as": "crash", "suspect": "n2", "in_place": True}
    ]
    history = History.from_events(as_events(events))
    assert history.suspected == {"n2": 1} and history.crash_retries == 1
    second = decide(facts, history, BUDGETS, can_exclude_nodes=True)
    assert (second.action, second.replace, second.counts_as) == (Action.CONTINUE, (("n2", "n3"),), "node")
    assert "second crash pinned on it" in second.reason


def test_a_run_that_restarts_without_a_new_checkpoint_stops_as_no_progress(tmp_path: Path) -> None:
    """NVRx's "no progress" exit: a restart loop that only burns the allocation ends with that
    reason. The newest checkpoint is read from the checkpoint folder (an async save's ledger line
    comes late, or never when the attempt is killed), and each failure's continuation records it."""
    budgets = Budgets(3, 5, 5, 5, max_restarts_without_progress=3)
    crash = {"event": "requeued", "cause": "crash", "counts_as": "crash", "checkpoint": 20}
    hang = {"event": "requeued", "cause": "hang", "counts_as": "hang", "checkpoint": 20}
    stuck = History.from_events(as_events([{**crash, "checkpoint": None}, crash, hang, crash]))
    assert stuck.no_progress(20) == 3 and stuck.no_progress(30) == 0
    d = decide(Facts(CRASH, in_place_ok=True, newest_checkpoint=20), stuck, budgets, can_exclude_nodes=True)
    assert (
        d.action is Action.FAIL and "no progress: 3 restarts in a row" in d.reason and "step 20" in d.reason
    )
    # a new checkpoint since the last failure is progress
    d = decide(Facts(CRASH, in_place_ok=True, newest_checkpoint=30), stuck, budgets, can_exclude_nodes=True)
    assert d.action is Action.CONTINUE
    # a timeout's requeue breaks the streak; a stop is never refused for it
    timeout = {"event": "requeued", "cause": "timeout", "counts_as": "requeue", "checkpoint": 20}
    assert History.from_events(as_events([crash, crash, crash, timeout])).no_progress(20) == 0
    stopped = Facts(AttemptOutcome("stopped", "timeout", 40), newest_checkpoint=20)
    assert decide(stopped, stuck, budgets, can_exclude_nodes=True).action is Action.CONTINUE
    # the folder's newest published step (not a temporary, not one set aside)
    paths = RunPaths(tmp_path).ensure()
    assert newest_checkpoint_step(paths) is None
    for name in ("step_000010", "step_000020", ".step_000030.tmp-ab12", "step_000040.corrupt"):
        (paths.checkpoints / name).mkdir(parents=True)
    assert newest_checkpoint_step(paths) == 20


def test_roster_without_failed_nodes_puts_healthy_spares_in_their_places() -> None:
    roster = Roster(("n1", "n2"), ("n3", "n4"))
    assert roster.without({"n2": "x", "n3": "y"}) == Roster(("n1", "n4"), ())
    assert roster.without({}) == roster
    uncovered = Roster(("n1", "n2"), ()).without({"n1": "x"})
    assert uncovered.training == ("n1", "n2")  # the caller sees it is not covered


def test_beating_in_a_thread_keeps_a_node_alive_for_an_observer(tmp_path: Path) -> None:
    """The real beat loop (a thread) against an observer on the real monotonic clock."""
    beating = alloc(tmp_path, "n1")
    observer = alloc(tmp_path, "n2")
    observer.clock = time.monotonic
    try:
        beating.start_beating()
        first = (beating.beats / "n1").read_text()
        deadline = time.monotonic() + 60
        while (beating.beats / "n1").read_text() == first and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (beating.beats / "n1").read_text() != first
        assert observer.alive("n1")
    finally:
        beating.stop_beating()


def test_a_single_training_node_names_no_suspect_by_signals() -> None:
    assert suspect(_reports(n1={"0": -9}), {}) is None  # nobody else to compare with, no spare either
