"""Issue 28 on the real local SLURM, 3-node layout (n1, n2 training; n3 a hot spare): the memory
tier (disk every 20 steps, memory every 5) restores in place from memory, not from the disk.

* A rank SIGKILLed after the snapshot of step 35: the in-place restart resumes from the snapshot of
  step 35 or the one before, each rank from its own node's memory.
* Every job process on n2 SIGKILLed after the snapshot of step 35, and every snapshot n2 held
  removed (the local nodes share one /dev/shm; on a real cluster n2's memory dies with it): the spare
  n3 takes n2's place and its ranks are sent their shards by n1, which kept them as n2's buddy.

Both finish bitwise equal to a run never interrupted, under one job id, and the ledger says which
node served each shard."""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from tests.cluster.test_slurm_in_place import _kill_node, _one_job_no_requeue, _rank_on
from tests.runlib import (
    TINY,
    events,
    final_params_sha,
    hpclaunch,
    synth_data,
    tiny_overrides,
    wait_for,
    wait_run_done,
)

from hpclaunch.rundir import SNAPSHOT_SAVED

if TYPE_CHECKING:
    from tests.cluster.conftest import SlurmCluster

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

STEPS = 80
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


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("memory-tier")


@pytest.fixture(scope="module")
def data(work: Path) -> Path:
    return synth_data(work / "data")


@pytest.fixture(scope="module")
def reference(slurm_cluster_3nodes: SlurmCluster, work: Path, data: Path) -> str:
    """The same run without the memory tier, never interrupted, on two nodes of the same cluster."""
    overrides = tiny_overrides(work, data, "reference", *COMMON, "testing.step_sleep_s=0")
    hpclaunch("submit", str(TINY), *overrides, "--no-preflight", cwd=work)
    s = wait_run_done(work / "runs" / "reference", work, timeout=600)
    assert s["state"] == "finished", json.dumps(s, indent=1)[-2000:]
    return final_params_sha(work / "runs" / "reference")


def _submit(work: Path, name: str, data: Path) -> tuple[Path, Path]:
    shm = Path("/dev/shm") / f"hpclaunch-test-{work.name}-{name}"
    overrides = tiny_overrides(work, data, name, *COMMON, *MEMORY, f"checkpoint.memory.dir={shm}")
    hpclaunch("submit", str(TINY), *overrides, "--no-preflight", cwd=work)
    return work / "runs" / name, shm


def _after_snapshot_35(run: Path) -> None:
    wait_for(
        lambda: any(e["event"] == SNAPSHOT_SAVED and e.get("step", 0) >= 35 for e in events(run)),
        timeout=300,
        poll=0.05,
        what="the snapshot of step 35",
    )


def _resumed(run: Path) -> dict[str, Any]:
    return [e for e in events(run) if e["event"] == "resumed"][-1]


def test_a_rank_killed_resumes_in_place_from_its_nodes_memory(
    slurm_cluster_3nodes: SlurmCluster, work: Path, data: Path, reference: str
) -> None:
    run, shm = _submit(work, "rank-killed", data)
    _after_snapshot_35(run)
    _rank_on(run, "n2").send_signal(signal.SIGKILL)
    s = wait_run_done(run, work, timeout=600)
    assert s["state"] == "finished", json.dumps(s, indent=1)[-3000:]
    first, second = s["attempts"][:2]
    assert (first["end"], first["cause"]) == ("restarted in place", "crash")
    r = _resumed(run)
    assert r["tier"] == "memory" and r["step"] in (30, 35) and r["disk_step"] == 20, r
    assert r["shards_from"] == {"n1": [0, 1], "n2": [2, 3]}  # every rank from its own node
    assert (second["resumed_from"], second["memory_saved_steps"]) == ("memory", r["step"] - 20)
    _one_job_no_requeue(slurm_cluster_3nodes, run)
    assert final_params_sha(run) == reference
    assert not shm.exists()  # the run ended with its last save on disk: every node's memory freed


def test_a_dead_node_is_replaced_by_the_spare_which_restores_from_the_buddys_copy(
    slurm_cluster_3nodes: SlurmCluster, work: Path, data: Path, reference: str
) -> None:
    run, shm = _submit(work, "node-dead", data)
    _after_snapshot_35(run)
    assert _kill_node(slurm_cluster_3nodes, "n2")
    shutil.rmtree(shm / "n2")  # what n2 held dies with it: only its buddy's copy can serve
    s = wait_run_done(run, work, timeout=600)
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
    assert final_params_sha(run) == reference
    assert not shm.exists()
