"""Scheduler environment -> NodeContext; never a silent localhost fallback."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpclaunch.jobs import env as job_env
from hpclaunch.jobs.env import (
    NodeContext,
    NodeContextError,
    expand_slurm_nodelist,
    node_context,
    read_pbs_nodefile,
)


def test_slurm_multi_node_context() -> None:
    ctx = node_context(
        {
            "SLURM_JOB_ID": "42",
            "SLURM_JOB_NODELIST": "gpu[07-08]",
            "SLURM_JOB_NUM_NODES": "2",
            "SLURM_NODEID": "1",
            "SLURMD_NODENAME": "gpu08",
            "SLURM_RESTART_COUNT": "3",
        },
        time_limit_s=600,
        now=1000.0,
    )
    assert (ctx.scheduler, ctx.job_id, ctx.node_rank, ctx.num_nodes) == ("slurm", "42", 1, 2)
    assert ctx.hosts == ("gpu07", "gpu08") and ctx.head == "gpu07" and ctx.hostname == "gpu08"
    assert ctx.restart_count == 3 and ctx.attempt == "42.3"
    assert ctx.end_time == 1600.0


def test_slurm_array_task_requeues_its_own_id() -> None:
    ctx = node_context(
        {
            "SLURM_JOB_ID": "57",
            "SLURM_ARRAY_JOB_ID": "55",
            "SLURM_ARRAY_TASK_ID": "2",
            "SLURM_JOB_NODELIST": "n1",
        }
    )
    assert ctx.job_id == "55_2" and ctx.array_task == 2


def test_slurm_multi_node_without_node_id_fails_loudly() -> None:
    with pytest.raises(NodeContextError, match="SLURM_NODEID is not set"):
        node_context({"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_NUM_NODES": "2"})


def test_nodelist_expansion() -> None:
    assert expand_slurm_nodelist("n[1-3,07],gpu01,a[08-10]") == [
        "n1",
        "n2",
        "n3",
        "n07",
        "gpu01",
        "a08",
        "a09",
        "a10",
    ]
    assert expand_slurm_nodelist("vm") == ["vm"]


def test_pbs_nodefile_is_deduplicated_in_order(tmp_path: Path) -> None:
    nodefile = tmp_path / "nodes"
    nodefile.write_text("c1\nc1\nc1\nc2\nc2\nc3\n")
    assert read_pbs_nodefile(str(nodefile)) == ["c1", "c2", "c3"]
    ctx = node_context({"PBS_JOBID": "9.server", "PBS_NODEFILE": str(nodefile), "PMI_RANK": "2"})
    assert (ctx.scheduler, ctx.num_nodes, ctx.node_rank, ctx.hostname, ctx.head) == ("pbs", 3, 2, "c3", "c1")


def test_pbs_without_nodefile_runs_one_node_on_this_host() -> None:
    ctx = node_context({"PBS_JOBID": "12", "PBS_ARRAY_INDEX": "1"})
    assert ctx.num_nodes == 1 and ctx.node_rank == 0 and ctx.array_task == 1


def test_pbs_cannot_tell_which_node_fails(tmp_path: Path) -> None:
    nodefile = tmp_path / "nodes"
    nodefile.write_text("c1\nc2\n")
    with pytest.raises(NodeContextError, match="cannot tell which of the 2 PBS nodes"):
        node_context({"PBS_JOBID": "9", "PBS_NODEFILE": str(nodefile)})


def test_local_context_uses_controller_variables() -> None:
    ctx = node_context(
        {"HPCLAUNCH_JOB_ID": "local77", "HPCLAUNCH_RESTART_COUNT": "2", "HPCLAUNCH_JOB_END_TIME": "123.5"}
    )
    assert (ctx.scheduler, ctx.job_id, ctx.restart_count, ctx.end_time) == ("local", "local77", 2, 123.5)


def test_multi_node_head_on_loopback_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(job_env, "slurm_node_addr", lambda node, timeout=10.0: None)
    ctx = NodeContext(
        scheduler="slurm",
        job_id="1",
        node_rank=0,
        num_nodes=2,
        hostname="localhost",
        hosts=("localhost", "other"),
    )
    with pytest.raises(NodeContextError, match="loopback"):
        job_env.rendezvous_address(ctx)
    one = NodeContext(
        scheduler="slurm", job_id="1", node_rank=0, num_nodes=1, hostname="localhost", hosts=("localhost",)
    )
    assert job_env.rendezvous_address(one) == "127.0.0.1"  # fine when nobody else must reach it


def test_the_plans_scheduler_wins_over_detection() -> None:
    """Slurm's Torque emulation sets SLURM_* and PBS_* at once: a PBS plan reads the PBS side."""
    environ = {
        "SLURM_JOB_ID": "26",
        "SLURM_JOB_NODELIST": "vm",
        "PBS_JOBID": "26",
        "HPCLAUNCH_RESTART_COUNT": "1",
    }
    assert node_context(environ).scheduler == "slurm"
    ctx = node_context(environ, kind="pbs")
    assert (ctx.scheduler, ctx.job_id, ctx.restart_count) == ("pbs", "26", 1)
    with pytest.raises(NodeContextError, match="PBS_JOBID is not set"):
        node_context({"SLURM_JOB_ID": "1"}, kind="pbs")
