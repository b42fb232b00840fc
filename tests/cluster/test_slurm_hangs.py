"""A hang on the real local SLURM (2-node layout): the watchdog names the node the hung rank runs
on, and the run continues as a new job that SLURM keeps off that node."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from tests.runlib import TINY, events, hpclaunch, synth_data, tiny_overrides, wait_run_done

if TYPE_CHECKING:
    from tests.cluster.conftest import SlurmCluster

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def test_the_node_that_hung_is_excluded_and_the_run_finishes_on_the_other(
    slurm_cluster_2nodes: SlurmCluster, tmp_path: Path
) -> None:
    data = synth_data(tmp_path / "data")
    overrides = tiny_overrides(
        tmp_path,
        data,
        "slurmhang",
        "scheduler.kind=slurm",  # a run of one node (tiny: 2 ranks on it)
        "train.steps=20",
        "train.warmup_steps=5",
        "checkpoint.every_steps=5",
        "watchdog.step_min_s=10",
        "watchdog.step_factor=1",
        "watchdog.poll_s=1",
        "testing.hang=[{rank: 1, phase: data, step: 8}]",
    )
    hpclaunch("submit", str(TINY), *overrides, "--no-preflight", cwd=tmp_path)
    run = tmp_path / "runs" / "slurmhang"
    s = wait_run_done(run, tmp_path, timeout=400)
    story = events(run)
    assert s["state"] == "finished", json.dumps(s, indent=1)[-3000:]

    started = [e for e in story if e["event"] == "started"]
    hung_on = started[0]["hosts"][0]
    other = next(n for n in slurm_cluster_2nodes.nodes if n != hung_on)
    hang = next(e for e in story if e["event"] == "hang")
    assert (hang["phase"], hang["step"], hang["ranks"]) == ("data", 8, [1])
    assert hang["culprit"] == f"rank 1 on {hung_on}" and hang["culprit_node"] == hung_on

    excluded = [e for e in story if e["event"] == "node_excluded"]
    assert [e["nodes"] for e in excluded] == [[hung_on]] and excluded[0]["node"] == 0
    requeued = next(e for e in story if e["event"] == "requeued")
    assert (requeued["cause"], requeued["action"]) == ("hang", "exclude")
    assert (s["attempts"][0]["end"], s["attempts"][0]["cause"]) == ("requeued", "hang")

    # the continuation: a new job, submitted with --exclude, on the other node, from checkpoint 5
    assert started[-1]["hosts"] == [other] and started[-1]["job_id"] != started[0]["job_id"]
    assert hung_on in slurm_cluster_2nodes.job_info(str(started[-1]["job_id"])).get("ExcNodeList", "")
    assert [e["step"] for e in story if e["event"] == "resumed"] == [0, 5]
    stacks = sorted((run / "logs" / f"attempt-{hang['attempt']}").glob("rank*.stacks.txt"))
    assert [p.name for p in stacks] == ["rank0.stacks.txt", "rank1.stacks.txt"]
    assert "in hang_forever" in stacks[1].read_text()
