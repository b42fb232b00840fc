"""Two PBS nodes (pbsn1, pbsn2 in their own network namespaces): one node agent per node through
each launcher `scheduler.pbs_launcher` names (MPICH's mpiexec over TM, and pbsdsh), torch's c10d
rendezvous on the head's address from PBS_NODEFILE, world size 4; and a node that fails its node check being
avoided by the job that continues the run.

The runs are submitted together and overlap. The two launchers train the same config on the same
4 ranks, so their final parameters must be bitwise equal.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from tests.pbs.conftest import user_dir
from tests.pbs.pbslib import submit, synth_data, wait_run_done
from tests.runlib import events, final_params_sha

if TYPE_CHECKING:
    from tests.pbs.conftest import PbsServer

pytestmark = [pytest.mark.pbs, pytest.mark.slow]

TWO_NODES = (
    "scheduler.nodes=2",
    "scheduler.procs_per_node=2",
    "train.global_batch=16",
    "train.micro_batch=2",
    "train.steps=25",
    "train.warmup_steps=5",
    "scheduler.time_limit=00:05:00",
)


@pytest.fixture(scope="module")
def runs(pbs_server_2nodes: PbsServer) -> dict[str, Any]:
    server = pbs_server_2nodes
    work = user_dir(server, "twonodes")
    data = synth_data(server, work / "data")
    markers = user_dir(server, "markers")
    (markers / "unhealthy-pbsn1").write_text("test: ECC errors reported by the admin\n")
    return {
        "work": work,
        # both jobs' head is pbsn1 (shared nodes here): each rendezvous gets its own port
        "mpiexec": submit(
            server,
            work,
            data,
            "mpiexec",
            *TWO_NODES,
            "scheduler.pbs_launcher=mpiexec",
            "launch.rdzv_port=29510",
        ),
        "pbsdsh": submit(
            server,
            work,
            data,
            "pbsdsh",
            *TWO_NODES,
            "scheduler.pbs_launcher=pbsdsh",
            "launch.rdzv_port=29520",
        ),
        # one node; the scheduler fills pbsn1 first (node priorities), where the admin marker is
        "exclude": submit(
            server,
            work,
            data,
            "exclude",
            "train.steps=20",
            "train.warmup_steps=5",
            "launch.pass_env=[HPCLAUNCH_NODE_MARKER_DIR]",
            env={"HPCLAUNCH_NODE_MARKER_DIR": str(markers)},
        ),
    }


@pytest.mark.parametrize("launcher", ["mpiexec", "pbsdsh"])
def test_two_nodes_one_agent_each_world_size_four(
    pbs_server_2nodes: PbsServer, runs: dict[str, Any], launcher: str
) -> None:
    run: Path = runs[launcher]
    script = (run / "job.pbs").read_text()
    # 2 ranks x (1 loader worker + the rank + its writer) per node
    assert "#PBS -l select=2:ncpus=6:mpiprocs=1\n#PBS -l place=scatter\n" in script
    s = wait_run_done(pbs_server_2nodes, run, timeout=300)
    assert s["state"] == "finished", json.dumps(s, indent=1)[-3000:]
    story = events(run)
    started = [e for e in story if e["event"] == "started"]
    assert sorted(e["node"] for e in started) == [0, 1]
    assert {tuple(e["hosts"]) for e in started} == {("pbsn1", "pbsn2")}  # PBS_NODEFILE, head first
    assert sorted(e["host"] for e in started) == ["pbsn1", "pbsn2"]  # one agent on each node
    resumed = next(e for e in story if e["event"] == "resumed")
    assert resumed["world_size"] == 4
    head_log = next((run / "logs").glob("attempt-*/node0.log")).read_text()
    assert '"rdzv_endpoint": "10.201.1.11:295' in head_log  # pbsn1's address, never localhost
    job = pbs_server_2nodes.job(s["attempts"][0]["job_id"])
    assert job["exec_host"].split("+")[0].startswith("pbsn1/") and "pbsn2/" in job["exec_host"]


def test_both_launchers_train_the_same_parameters(pbs_server_2nodes: PbsServer, runs: dict[str, Any]) -> None:
    for launcher in ("mpiexec", "pbsdsh"):
        assert wait_run_done(pbs_server_2nodes, runs[launcher], timeout=300)["state"] == "finished"
    assert final_params_sha(runs["mpiexec"]) == final_params_sha(runs["pbsdsh"])


def test_a_node_that_fails_its_check_is_avoided_by_the_next_job(
    pbs_server_2nodes: PbsServer, runs: dict[str, Any]
) -> None:
    run: Path = runs["exclude"]
    s = wait_run_done(pbs_server_2nodes, run, timeout=300)
    assert s["state"] == "finished", json.dumps(s, indent=1)[-3000:]
    story = events(run)
    started = [e for e in story if e["event"] == "started"]
    assert started[0]["hosts"] == ["pbsn1"], "PBS placed the first attempt elsewhere; nothing to avoid"
    assert started[-1]["hosts"] == ["pbsn2"]
    failed_check = next(e for e in story if e["event"] == "node_preflight" and not e["ok"])
    assert any(c["name"] == "node" and c["status"] == "fail" for c in failed_check["checks"])
    excluded = [e for e in story if e["event"] == "node_excluded"]
    assert [e["nodes"] for e in excluded] == [["pbsn1"]]
    assert (s["attempts"][0]["end"], s["attempts"][0]["cause"]) == ("requeued", "node_failure")
    # PBS cannot say "not pbsn1" in a select: the new job names the healthy host instead
    new_job = pbs_server_2nodes.job(str(started[-1]["job_id"]))
    assert "host=pbsn2" in new_job["Resource_List"]["select"]
    assert "#PBS -l select=1:ncpus=6:mpiprocs=1:host=pbsn2" in (run / "job.pbs").read_text()
