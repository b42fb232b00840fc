"""The watchdog: its windows, who the culprit of a hang is, and what it does with real files,
real processes and a real ledger (the agent's poll loop is replaced by calls with a given clock)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from hpclaunch.config import WatchdogConfig
from hpclaunch.jobs.allocation import LOOK_S
from hpclaunch.jobs.hang_evidence import dump_stacks, stop_workers
from hpclaunch.jobs.watchdog import (
    RankState,
    Verdict,
    Watchdog,
    Watched,
    culprits,
    find_hang,
    read_verdict,
    startup_hang,
    window_s,
)
from hpclaunch.rundir import AttemptOutcome, Ledger, RunPaths, read_events
from hpclaunch.rundir.progress_files import hang_file, progress_file, stacks_file
from hpclaunch.schedulers.protocol import NodeContext

CFG = WatchdogConfig(launch_s=300, startup_s=120, checkpoint_s=600, step_min_s=60, step_factor=10, poll_s=1)


def test_windows_per_phase() -> None:
    assert window_s(CFG, "startup", stepped=False, recent_max_step_s=None) == 120
    for phase in ("load", "save", "eval", "done"):
        assert window_s(CFG, phase, stepped=True, recent_max_step_s=1.0) == 600
    # training: max(step_min_s, k x the slowest recent step)
    assert window_s(CFG, "compute", stepped=True, recent_max_step_s=0.2) == 60
    assert window_s(CFG, "data", stepped=True, recent_max_step_s=9.0) == 90
    # the first step of an attempt (warm-up, compilation) gets the start-up window
    assert window_s(CFG, "compute", stepped=False, recent_max_step_s=None) == 120


def st(
    rank: int,
    phase: str,
    step: int = 12,
    *,
    node: str | None = "n1",
    waiting: str | None = None,
    stalled: float = 0,
) -> RankState:
    window = window_s(CFG, phase, stepped=True, recent_max_step_s=0.5) if node else CFG.launch_s
    return RankState(rank, node, step, phase, waiting, stalled, window)


# (name, states, culprit ranks, culprit node or None, phrase in the reason; None: no hang yet)
CASES = [
    (
        "a rank still in data while the other waits in DDP's backward",
        [st(0, "compute", stalled=61), st(1, "data", stalled=61)],
        (1,),
        "n1",
        "rank 1 on n1 hung in data at step 12",
    ),
    (
        "the hung rank is behind by a step (the others finished theirs)",
        [st(0, "data", 13, stalled=70), st(1, "collective", 12, stalled=70), st(2, "save", 12, stalled=70)],
        (),
        None,
        None,  # rank 2 is in a save: its own (long) window decides, not the step window
    ),
    (
        "every rank waits in a collective: no single culprit, nodes not named",
        [
            st(0, "collective", node="n1", stalled=61),
            st(1, "compute", node="n2", waiting="all_reduce", stalled=61),
        ],
        (),
        None,
        "no single culprit known",
    ),
    (
        "every rank stuck at the same place on a one-node run: the node is named",
        [st(0, "compute", stalled=65), st(1, "compute", stalled=65)],
        (),
        "n1",
        "every rank runs on n1",
    ),
    (
        "start-up: one rank waits in the smoke test's barrier",
        [st(0, "startup", 0, waiting="monitored_barrier", stalled=130), st(1, "startup", 0, stalled=130)],
        (1,),
        "n1",
        "rank 0 on n1 is in startup (in monitored_barrier)",
    ),
    (
        "a save: the rank that never entered DCP's collective",
        [st(0, "save", 20, waiting="broadcast", stalled=601), st(1, "save", 20, stalled=601)],
        (1,),
        "n1",
        "hung in save at step 20",
    ),
    (
        "two ranks of one node behind: that node",
        [
            st(0, "collective", node="n1", stalled=61),
            st(1, "collective", node="n1", stalled=61),
            st(2, "data", node="n2", stalled=61),
            st(3, "data", node="n2", stalled=61),
        ],
        (2, 3),
        "n2",
        "ranks 2, 3 on n2 hung in data",
    ),
    (
        "culprits on two nodes: ranks named, no node",
        [
            st(0, "collective", node="n1", stalled=61),
            st(1, "data", node="n1", stalled=61),
            st(2, "data", node="n2", stalled=61),
        ],
        (1, 2),
        None,
        "ranks 1, 2 on n1, n2",
    ),
    (
        "a rank that never reported: behind everyone, its node unknown",
        [st(0, "startup", 0, waiting="barrier", stalled=301), st(1, "launch", 0, node=None, stalled=301)],
        (1,),
        None,
        "rank 1 hung in launch (never reported)",
    ),
    ("world size 1: the only rank", [st(0, "data", stalled=61)], (0,), "n1", "rank 0 on n1 hung in data"),
    (
        "a long save holds a rank that waits in the next step: not a hang yet",
        [st(0, "save", 10, stalled=200), st(1, "compute", 11, stalled=200)],
        (),
        None,
        None,
    ),
]


@pytest.mark.parametrize("states,ranks,node,phrase", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_verdicts(
    states: list[RankState], ranks: tuple[int, ...], node: str | None, phrase: str | None
) -> None:
    verdict = find_hang(states, attempt="j.0", now=1000.0)
    if phrase is None:
        assert verdict is None
        return
    assert verdict is not None
    assert verdict.ranks == ranks and verdict.culprit_node == node
    assert phrase in verdict.reason, verdict.reason
    assert verdict.culprit == ("no single culprit known" if not ranks else verdict.culprit)


def test_the_culprit_is_found_before_its_window_passes() -> None:
    states = [st(0, "compute", stalled=5), st(1, "data", stalled=5)]
    assert [s.rank for s in culprits(states)] == [1]
    assert find_hang(states, attempt="j.0", now=1000.0) is None


# ---- the watchdog with real files --------------------------------------------------------------


def ctx(node_rank: int = 0, num_nodes: int = 1) -> NodeContext:
    hosts = tuple(f"n{i + 1}" for i in range(num_nodes))
    return NodeContext("local", "j", node_rank, num_nodes, hosts[node_rank], hosts)


def beat(paths: RunPaths, rank: int, phase: str, step: int, since: float, **extra: object) -> None:
    path = progress_file(paths, "j.0", rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"rank": rank, "node": "n1", "pid": None, "step": step, "phase": phase, "phase_since": since}
    path.write_text(json.dumps({**record, "updated": since, "last_step_s": 0.2, **extra}))


def test_a_stalled_rank_becomes_a_hang_event_and_a_verdict_file(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path).ensure()
    ledger = Ledger(paths, role="agent", attempt="j.0", node=0)
    dog = Watchdog(CFG, paths, ctx(), ledger, Watched(world_size=2), launched_at=0.0)
    beat(paths, 0, "compute", 12, 100.0)
    beat(paths, 1, "data", 12, 100.0)
    assert dog.check(lambda: [], now=101.0) is None  # first sight: the windows start now
    assert dog.check(lambda: [], now=101.5) is None  # not due yet (poll_s = 1)
    beat(paths, 0, "collective", 12, 130.0, waiting="all_reduce")  # rank 0 moved on, rank 1 did not
    assert dog.check(lambda: [], now=130.0) is None
    verdict = dog.check(lambda: [], now=162.0)
    assert verdict is not None and verdict.ranks == (1,) and verdict.phase == "data" and verdict.step == 12
    assert verdict.stalled_s == pytest.approx(61.0) and verdict.window_s == 60
    assert read_verdict(paths, "j.0") == verdict  # what the other nodes act on
    hang = [e.record for e in read_events(paths).named("hang")]
    assert len(hang) == 1 and hang[0]["culprit"] == "rank 1 on n1" and hang[0]["culprit_node"] == "n1"
    assert hang[0]["node"] == 0  # the ledger's writer field is kept
    assert dog.check(lambda: [], now=500.0) is verdict  # decided once


def test_a_rank_that_never_reports_is_judged_from_the_launch(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path).ensure()
    ledger = Ledger(paths, role="agent", attempt="j.0", node=0)
    dog = Watchdog(CFG, paths, ctx(), ledger, Watched(world_size=2), launched_at=0.0)
    beat(paths, 0, "startup", 0, 50.0, waiting="barrier", last_step_s=None)
    assert dog.check(lambda: [], now=299.0) is None
    verdict = dog.check(lambda: [], now=301.0)
    assert verdict is not None and verdict.ranks == (1,) and "never reported" in verdict.reason


def test_ranks_the_smoke_test_names_are_a_start_up_hang_on_their_node(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path).ensure()
    beat(paths, 0, "done", 0, 50.0)
    beat(paths, 1, "startup", 0, 40.0)
    missed = AttemptOutcome("failed", "hang", 0, "rank 1 did not reach the barrier within 60 s", 2)
    missed.extra.update(phase="startup", ranks=[1])
    verdict = startup_hang(paths, "j.0", missed, window_s=60)
    assert verdict is not None and verdict.ranks == (1,) and verdict.phase == "startup"
    assert verdict.culprit == "rank 1 on n1" and verdict.culprit_node == "n1" and verdict.window_s == 60
    assert "did not reach the barrier" in verdict.reason and verdict.source == "distributed smoke test"
    old = {k: v for k, v in verdict.to_json().items() if k != "source"}  # a hang.json from before
    assert Verdict.from_json(old).source == "watchdog"
    # a rank without a heartbeat names no node, so a continuation is never kept off a guessed one
    missed.extra["ranks"] = [1, 2]
    verdict = startup_hang(paths, "j.0", missed, window_s=60)
    assert verdict is not None and verdict.culprit_node is None and verdict.culprit == "rank 1 on n1, rank 2"
    for other in (
        None,
        AttemptOutcome("failed", "crash", 0, "boom", 2),
        AttemptOutcome("failed", "training", 3, "non-finite", 2),
        AttemptOutcome("stopped", "timeout", 5, None, 2),
    ):
        assert startup_hang(paths, "j.0", other, window_s=60) is None


def test_other_nodes_follow_node_0s_verdict(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path).ensure()
    other = Watchdog(CFG, paths, ctx(1, 2), Ledger(paths, role="agent", node=1), Watched(world_size=2))
    now = time.time() + 1000
    assert other.check(lambda: [], now=now) is None
    hang_file(paths, "j.0").parent.mkdir(parents=True, exist_ok=True)
    states = [st(0, "collective", node="n1", stalled=61), st(1, "data", node="n2", stalled=61)]
    verdict = find_hang(states, attempt="j.0", now=now)
    assert verdict is not None
    hang_file(paths, "j.0").write_text(json.dumps(verdict.to_json()))
    (paths.attempt_dir("j.0") / "hang.node0.json").write_text("{}")  # node 0 has dumped its ranks
    began = time.time()
    assert other.check(lambda: [], now=now + 1) is None  # a follower reads the verdict per follow_s
    assert other.follow_s == max(CFG.poll_s, LOOK_S)
    assert other.check(lambda: [], now=now + other.follow_s) == verdict
    assert time.time() - began < 5  # it did not wait for node 0 longer than needed
    assert (paths.attempt_dir("j.0") / "hang.node1.json").exists()  # node 0 waits for this
    assert not [e.record for e in read_events(paths).named("hang")]  # only node 0 records


WORKER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from hpclaunch.config import RunConfig
    from hpclaunch.rundir import RunPaths
    from hpclaunch.rank.progress import register_stack_dump

    register_stack_dump(RunConfig(), RunPaths(Path(sys.argv[1])), "j.0", 3)

    def stuck_in_a_test_function():
        print("ready", flush=True)
        while True:
            time.sleep(1)

    stuck_in_a_test_function()
    """
)


def test_stacks_are_dumped_from_a_stuck_process_and_it_is_stopped(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path).ensure()
    proc = subprocess.Popen(
        [sys.executable, "-c", WORKER, str(tmp_path)],
        env={**os.environ, "RANK": "3"},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        dumped = dump_stacks(paths, "j.0", [proc.pid], "test hang", wait_s=10)
        assert dumped == [3]
        text = stacks_file(paths, "j.0", 3).read_text()
        assert "# hpclaunch watchdog" in text and "test hang" in text
        assert "in stuck_in_a_test_function" in text  # the function that hung, named by faulthandler
        assert proc.poll() is None  # a dump does not stop the worker
        stop_workers([proc.pid])
        assert proc.wait(timeout=10) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()


def test_the_flight_recorder_variables_are_known_and_point_into_the_attempt_logs(tmp_path: Path) -> None:
    from hpclaunch.jobs.hang_evidence import flight_recorder_env
    from hpclaunch.nccl import validate_nccl_env

    paths = RunPaths(tmp_path).ensure()
    env = flight_recorder_env(paths, "j.0")
    assert validate_nccl_env(env) == []  # current names, valid values: no warning either
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1" and int(env["TORCH_FR_BUFFER_SIZE"]) > 0
    for name in ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_PIPE_FILE"):
        assert Path(env[name]).parent == paths.attempt_logs("j.0") / "nccl"
    assert Path(env["TORCH_FR_DUMP_TEMP_FILE"]).parent.is_dir()


def test_a_hang_event_lists_the_culprits_and_a_sample_of_the_other_ranks(tmp_path: Path) -> None:
    # both detectors (the watchdog and the smoke test) write the hang event from these fields
    states = tuple({"rank": r, "node": f"n{r // 8}", "phase": "collective"} for r in range(300))
    verdict = Verdict(
        "j.0", "data", 7, "rank 250 on n31", (250,), "n31", "why", 60.0, 61.0, 0.0, 61.0, states
    )
    fields = verdict.ledger_fields()
    assert "attempt" not in fields and fields["ranks"] == (250,) and fields["culprit_node"] == "n31"
    ranks = [st["rank"] for st in fields["states"]]
    assert ranks == [*range(32), 250]  # the first 32 ranks and the culprit, not all 300
    assert len(verdict.to_json()["states"]) == 300  # hang.json keeps every rank
