"""Issue 36, finding 6: each agent aggregates its own node's rank progress into one file per node,
and the decider reads one file per node, all of them only when a node says a rank stalled. Real
files (the ranks' heartbeats in each node's local folder, the node files in the run directory);
the clock the watchdog judges with is the test's."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from hpclaunch.config import WatchdogConfig
from hpclaunch.jobs.node_progress import prepare_local_dir, remove_local_dirs, stalled_dir
from hpclaunch.jobs.watchdog import Watchdog, Watched
from hpclaunch.rundir import Ledger, RunPaths, read_events
from hpclaunch.rundir.node_dir import NodeDir
from hpclaunch.rundir.progress_files import node_progress_file, read_progress
from hpclaunch.schedulers.protocol import NodeContext

pytestmark = pytest.mark.fast

CFG = WatchdogConfig(launch_s=300, startup_s=120, checkpoint_s=600, step_min_s=60, step_factor=10, poll_s=1)
HOSTS = ("n1", "n2")


def node_dir(paths: RunPaths) -> Path:
    """The nodes' directory (``rundir.node_dir``), in the test's own temporary directory."""
    tmp = paths.root / "node-tmp"
    tmp.mkdir(exist_ok=True)
    return NodeDir.prepare(tmp=tmp).path


def heartbeat(
    paths: RunPaths, host: str, rank: int, phase: str, step: int, since: float, **extra: object
) -> None:
    """A rank's heartbeat where the trainer leaves it under an agent: on its node."""
    local = prepare_local_dir(node_dir(paths), paths.root, host, "j.0")
    record = {"rank": rank, "node": host, "pid": None, "step": step, "phase": phase, "phase_since": since}
    (local / f"rank{rank}.progress.json").write_text(json.dumps({**record, "updated": since, **extra}))


def dog(paths: RunPaths, node: int, *, lead: bool) -> Watchdog:
    ctx = NodeContext("slurm", "j", node, 2, HOSTS[node], HOSTS)
    watched = Watched(
        world_size=4,
        local_dir=prepare_local_dir(node_dir(paths), paths.root, HOSTS[node], "j.0"),
        local_ranks=2,
        alone=False,
    )
    w = Watchdog(
        CFG,
        paths,
        ctx,
        Ledger(paths, role="agent", attempt="j.0", node=node),
        watched,
        launched_at=0.0,
        lead=lead,
    )
    w.ack_nodes = [0, 1]
    return w


def test_a_rank_stalled_on_another_node_is_judged_from_the_node_files(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path).ensure()
    lead, other = dog(paths, 0, lead=True), dog(paths, 1, lead=False)
    for rank, host in ((0, "n1"), (1, "n1"), (2, "n2")):
        heartbeat(paths, host, rank, "collective", 12, 100.0, waiting="all_reduce", last_step_s=0.2)
    heartbeat(paths, "n2", 3, "data", 12, 100.0, last_step_s=0.2)  # rank 3 is the one they wait for
    assert other.check(lambda: [], now=101.0) is None and lead.check(lambda: [], now=101.0) is None
    # The node files: one per node, every rank in its node's (status reads them).
    assert sorted(read_progress(paths, "j.0")) == [0, 1, 2, 3]
    assert not list(paths.attempt_dir("j.0").glob("rank*.progress.json"))  # no shared file per rank
    assert lead.check(lambda: [], now=150.0) is None  # inside the window: no node says a stall
    assert not stalled_dir(paths, "j.0").exists() or not os.listdir(stalled_dir(paths, "j.0"))
    assert other.check(lambda: [], now=170.0) is None  # n2 sees rank 3 past its 60 s: it says so
    assert os.listdir(stalled_dir(paths, "j.0")) == ["node1"]
    (paths.attempt_dir("j.0") / "hang.node1.json").write_text("{}")  # n2 will have dumped its ranks
    verdict = lead.check(lambda: [], now=175.0)
    assert verdict is not None and verdict.ranks == (3,) and verdict.culprit_node == "n2"
    assert verdict.stalled_s >= 60 and "rank 3 on n2" in verdict.reason
    assert [e.record["culprit"] for e in read_events(paths).named("hang")] == ["rank 3 on n2"]


def test_the_decider_reads_other_nodes_in_turn_and_finds_a_straggler(tmp_path: Path) -> None:
    """The straggler tracker is fed from the node files (each rank's last summaries ride in its
    heartbeat), not from every rank's steptimes file."""
    paths = RunPaths(tmp_path).ensure()
    lead, other = dog(paths, 0, lead=True), dog(paths, 1, lead=False)

    def summaries(rank: int, work: float) -> list[dict[str, object]]:
        node = "n1" if rank < 2 else "n2"
        return [
            {"attempt": "j.0", "rank": rank, "node": node, "step": step, "work_s": work, "step_s": 1.0}
            for step in (50, 100, 150)
        ]

    for rank in range(4):
        host = "n1" if rank < 2 else "n2"
        work = 0.9 if rank == 3 else 0.3
        heartbeat(paths, host, rank, "compute", 160, 100.0, last_step_s=1.0, summaries=summaries(rank, work))
    other.check(lambda: [], now=101.0)
    assert node_progress_file(paths, "j.0", 1).exists()
    lead.check(lambda: [], now=101.0)
    (found,) = [e.record for e in read_events(paths).named("straggler")]
    assert (found["rank"], found["rank_node"], found["windows"]) == (3, "n2", 3)


def test_an_agent_leaving_removes_its_own_attempts_heartbeats_only(tmp_path: Path) -> None:
    """The agent of the job that continues the run may already run beside it on this node."""
    paths = RunPaths(tmp_path).ensure()
    node = node_dir(paths)
    mine = [prepare_local_dir(node, paths.root, "n1", a) for a in ("j.0", "j.0.1")]
    theirs = prepare_local_dir(node, paths.root, "n1", "j.1")
    remove_local_dirs(node, paths.root, "n1", "j.0")
    assert not any(p.exists() for p in mine) and theirs.is_dir()


def test_a_node_directory_another_user_could_enter_is_not_written_into_the_node_uses_its_own(
    tmp_path: Path,
) -> None:
    """The ranks' heartbeats live in the node's shared /tmp: a hpclaunch-<uid>/ made first by someone
    else (here a link to elsewhere) was refused, and the refusal failed the whole run (issue 49, M4):
    the node now uses a private directory of its own, and says so."""
    made = NodeDir.prepare(tmp=tmp_path)
    assert made.path == tmp_path / f"hpclaunch-{os.getuid()}" and not made.fallback
    assert made.path.stat().st_mode & 0o777 == 0o700
    planted, elsewhere = tmp_path / "other", tmp_path / "elsewhere"
    planted.mkdir()
    elsewhere.mkdir(mode=0o700)
    (planted / f"hpclaunch-{os.getuid()}").symlink_to(elsewhere, target_is_directory=True)
    fallback = NodeDir.prepare(tmp=planted)
    assert "not a directory" in fallback.fallback
    assert fallback.path.parent == planted and fallback.path.name.startswith(f"hpclaunch-{os.getuid()}-")
    assert fallback.path.stat().st_mode & 0o777 == 0o700 and not fallback.path.is_symlink()
    local = prepare_local_dir(fallback.path, tmp_path / "run", "n1", "7.0")
    assert local.is_relative_to(fallback.path) and list(elsewhere.iterdir()) == []
    fallback.remove_fallback()
    assert not fallback.path.exists()


def test_a_short_runs_straggler_is_reported_at_the_attempts_end(tmp_path: Path) -> None:
    """Issue 49: a run that ended between two of the watchdog's polls never had its stragglers
    reported (nothing read the summaries once more at the attempt's end): ``final`` does."""
    paths = RunPaths(tmp_path).ensure()
    lead, other = dog(paths, 0, lead=True), dog(paths, 1, lead=False)
    for d in (lead, other):
        d.check(lambda: [], now=1.0)  # the polls during the run: no summary yet
    for rank in range(4):
        host = "n1" if rank < 2 else "n2"
        lines = [
            {"attempt": "j.0", "rank": rank, "node": host, "step": step, "work_s": 0.9 if rank == 1 else 0.3}
            for step in (5, 10, 15, 20)
        ]
        heartbeat(paths, host, rank, "done", 20, 2.0, last_step_s=0.1, summaries=lines)
    assert lead.check(lambda: [], now=1.5) is None  # (not due: the next poll would come after the end)
    other.final()  # each agent's last look, before it reports ...
    lead.final()  # ... and the decider's, after every report
    (found,) = [e.record for e in read_events(paths).named("straggler")]
    assert (found["rank"], found["rank_node"]) == (1, "n1")
    lead.final()  # (once)
    assert len(read_events(paths).named("straggler")) == 1
