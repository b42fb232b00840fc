"""Issue 28 on the real local SLURM, 3-node layout (n1, n2 training; n3 a hot spare): the memory
tier (disk every 20 steps, memory every 5) restores in place from memory, not from the disk.

* A rank SIGKILLed after the snapshot of step 35: the in-place restart resumes from the snapshot of
  step 35 or the one before, each rank from its own node's memory.
* Every job process on n2 SIGKILLed after the snapshot of step 35, and every snapshot n2 held
  removed (the local nodes share one /dev/shm; on a real cluster n2's memory dies with it): the spare
  n3 takes n2's place and its ranks are sent their shards by n1, which kept them as n2's buddy.

Both finish bitwise equal to a run never interrupted, under one job id, and the ledger says which
node served each shard. And issue 38 on the same cluster:

* the review's reproduction: a snapshot tmpfs with room for the ranks' own shards but not for their
  buddies' copies (it turned a 23-second run into one that failed after 283 s): the run finishes,
  bitwise equal, under one job, each rank saying once what the tier could not do;
* a run that fails through the scheduler leaves nothing of its snapshots on any node."""

from __future__ import annotations

import json
import shutil
import signal
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from tests.cluster.side_by_side import STEPS, SideBySide, kill_run_on
from tests.cluster.test_slurm_in_place import _one_job_no_requeue
from tests.runlib import (
    TINY,
    events,
    final_params_sha,
    hpclaunch,
    rank_on_node,
    synth_data,
    tiny_overrides,
    wait_for,
    wait_run_done,
)
from tests.shm_fixtures import small_tmpfs

from hpclaunch.config import load_config
from hpclaunch.rundir import SNAPSHOT_SAVED, RunPaths
from hpclaunch.rundir.shm import run_root

if TYPE_CHECKING:
    from tests.cluster.conftest import SlurmCluster

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

# side_by_side.COMMON's run (its uninterrupted end is the shared reference), slower
COMMON = (
    "scheduler.kind=slurm",
    "scheduler.nodes=2",  # tiny: 2 ranks per node, world size 4
    f"train.steps={STEPS}",
    "train.log_every=1",
    # (slow enough that the kill lands between the snapshot of 35 and the disk's save of 40)
    "testing.step_sleep_s=0.3",
    "checkpoint.every_steps=20",
    "scheduler.max_failure_retries=2",
    "scheduler.time_limit=00:10:00",
)
MEMORY = ("checkpoint.memory.every_steps=5", "scheduler.spare_nodes=1")
Ended = tuple[Path, Path, dict[str, Any]]  # a run, where its snapshots lived, its final status


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("memory-tier")


@pytest.fixture(scope="module", autouse=True)
def _bases_removed(work: Path) -> Iterator[None]:
    """The tests' tmpfs stand-ins in /dev/shm go with the module (their snapshots are freed by the
    runs themselves: what the tests check)."""
    yield
    for base in Path("/dev/shm").glob(f"hpclaunch-test-{work.name}-*"):
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="module")
def data(work: Path) -> Path:
    return synth_data(work / "data")


def _base(work: Path, name: str) -> Path:
    """The test's own tmpfs stand-in in /dev/shm (the nodes share this machine's)."""
    base = Path("/dev/shm") / f"hpclaunch-test-{work.name}-{name}"
    base.mkdir(exist_ok=True)
    return base


def _submit(work: Path, name: str, data: Path, *extra: str, base: Path | None = None) -> tuple[Path, Path]:
    """The run submitted, and where its snapshots live (one directory per node below it)."""
    base = base or _base(work, name)
    overrides = tiny_overrides(work, data, name, *COMMON, *MEMORY, *extra, f"checkpoint.memory.dir={base}")
    hpclaunch("submit", str(TINY), *overrides, "--no-preflight", cwd=work)
    run = work / "runs" / name
    return run, run_root(load_config(run / "config.yaml").checkpoint.memory, RunPaths(run))


def _after_snapshot_35(run: Path) -> None:
    wait_for(
        lambda: any(e["event"] == SNAPSHOT_SAVED and e.get("step", 0) >= 35 for e in events(run)),
        timeout=300,
        poll=0.05,
        what="the snapshot of step 35",
    )


def _resumed(run: Path) -> dict[str, Any]:
    return [e for e in events(run) if e["event"] == "resumed"][-1]


# ---- the runs, side by side (each story: submitted, its fault at its moment, its end) -------------


def _rank_killed(work: Path, data: Path) -> Ended:
    run, shm = _submit(work, "rank-killed", data)
    _after_snapshot_35(run)
    rank_on_node(run, "n2").send_signal(signal.SIGKILL)
    return run, shm, wait_run_done(run, work, timeout=600)


def _node_dead(cluster: SlurmCluster, work: Path, data: Path) -> Ended:
    run, shm = _submit(work, "node-dead", data)
    _after_snapshot_35(run)
    assert kill_run_on(cluster, run, "n2")
    shutil.rmtree(shm / "n2")  # what n2 held dies with it: only its buddy's copy can serve
    return run, shm, wait_run_done(run, work, timeout=600)


def _full_tmpfs(work: Path, data: Path) -> tuple[Path, list[Path], dict[str, Any]]:
    """4 ranks' own shards of ~4 MiB fit the 18 MiB tmpfs (the nodes share it here), their copies
    on the buddies do not, nor the next snapshots (keep_last 1). What the run left in the tmpfs
    is looked at before it goes."""
    with small_tmpfs(Path("/dev/shm") / f"hpclaunch-test-{work.name}-full", "18m") as base:
        run, shm = _submit(
            work, "full-tmpfs", data, "testing.step_sleep_s=0", "checkpoint.memory.keep_last=1", base=base
        )
        s = wait_run_done(run, work, timeout=600)
        return run, [*shm.parent.iterdir()] if shm.parent.exists() else [], s


def _fails(work: Path, data: Path) -> Ended:
    """A rank SIGKILLed with no retry left."""
    run, shm = _submit(work, "fails", data, "scheduler.max_failure_retries=0")
    wait_for(
        lambda: any(e["event"] == SNAPSHOT_SAVED for e in events(run)),
        timeout=300,
        poll=0.1,
        what="a snapshot",
    )
    assert [*shm.glob("n*/alloc-*/step-*/rank-*.bin")]
    rank_on_node(run, "n2").send_signal(signal.SIGKILL)
    return run, shm, wait_run_done(run, work, timeout=600)


@pytest.fixture(scope="module")
def runs(
    request: pytest.FixtureRequest,
    slurm_cluster_3nodes: SlurmCluster,
    work: Path,
    data: Path,
    common_reference: Future[str],
) -> Iterator[SideBySide]:
    cluster = slurm_cluster_3nodes
    with SideBySide(request) as runs:
        runs.start(
            "rank-killed",
            lambda: _rank_killed(work, data),
            for_tests=("test_a_rank_killed_resumes_in_place_from_its_nodes_memory",),
        )
        runs.start(
            "node-dead",
            lambda: _node_dead(cluster, work, data),
            for_tests=("test_a_dead_node_is_replaced_by_the_spare_which_restores_from_the_buddys_copy",),
        )
        runs.start(
            "full-tmpfs",
            lambda: _full_tmpfs(work, data),
            for_tests=("test_a_tmpfs_without_room_for_the_buddies_copies_never_stalls_the_run",),
        )
        runs.start(
            "fails",
            lambda: _fails(work, data),
            for_tests=("test_a_run_that_fails_leaves_no_snapshot_on_any_node",),
        )
        yield runs


# ---- the tests: each takes its run's end --------------------------------------------------------


def test_a_rank_killed_resumes_in_place_from_its_nodes_memory(
    slurm_cluster_3nodes: SlurmCluster, runs: SideBySide, common_reference: Future[str]
) -> None:
    run, shm, s = runs.result("rank-killed")
    assert s["state"] == "finished", json.dumps(s, indent=1)[-3000:]
    first, second = s["attempts"][:2]
    assert (first["end"], first["cause"]) == ("restarted in place", "crash")
    r = _resumed(run)
    assert r["tier"] == "memory" and r["step"] in (30, 35) and r["disk_step"] == 20, r
    assert r["shards_from"] == {"n1": [0, 1], "n2": [2, 3]}  # every rank from its own node
    assert (second["resumed_from"], second["memory_saved_steps"]) == ("memory", r["step"] - 20)
    _one_job_no_requeue(slurm_cluster_3nodes, run)
    assert final_params_sha(run) == common_reference.result()
    assert not shm.exists()  # the run ended with its last save on disk: every node's memory freed
    assert not [*shm.parent.iterdir()]


def test_a_dead_node_is_replaced_by_the_spare_which_restores_from_the_buddys_copy(
    slurm_cluster_3nodes: SlurmCluster, runs: SideBySide, common_reference: Future[str]
) -> None:
    run, shm, s = runs.result("node-dead")
    assert s["state"] == "finished", json.dumps(s, indent=1)[-3000:]
    first = s["attempts"][0]
    assert (first["end"], first["cause"], first["replaced"]) == (
        "restarted in place",
        "node_failure",
        {"n2": "n3"},
    )
    r = _resumed(run)
    assert r["tier"] == "memory" and r["step"] in (30, 35) and r["disk_step"] == 20, r
    # n3 held nothing: n1 served its own ranks and, as n2's buddy, n2's ranks to n3
    assert r["shards_from"] == {"n1": [0, 1, 2, 3]}, r
    _one_job_no_requeue(slurm_cluster_3nodes, run)
    assert final_params_sha(run) == common_reference.result()
    assert not shm.exists()


def test_a_tmpfs_without_room_for_the_buddies_copies_never_stalls_the_run(
    slurm_cluster_3nodes: SlurmCluster, runs: SideBySide, common_reference: Future[str]
) -> None:
    run, left, s = runs.result("full-tmpfs")
    assert s["state"] == "finished", json.dumps(s, indent=1)[-3000:]
    assert not left, left  # every node's memory freed
    _one_job_no_requeue(slurm_cluster_3nodes, run)
    assert final_params_sha(run) == common_reference.result()
    said = [e for e in events(run) if e["event"] == "snapshot_failed"]
    assert sorted(e["rank"] for e in said) == [0, 1, 2, 3], said  # once per rank, in its words
    assert all("no room for a snapshot shard" in e["error"] for e in said), said


def test_a_run_that_fails_leaves_no_snapshot_on_any_node(runs: SideBySide) -> None:
    """Every node's agent frees what its node held (the ranks died without freeing; before, the
    snapshots stayed in the nodes' memory)."""
    _, shm, s = runs.result("fails")
    assert s["state"] == "failed", json.dumps(s, indent=1)[-3000:]
    assert not shm.exists(), [*shm.rglob("*")]
