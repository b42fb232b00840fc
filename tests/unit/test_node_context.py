"""Scheduler environment -> NodeContext, per scheduler module; never a silent localhost fallback."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from hpclaunch.config import RunConfig, load_config
from hpclaunch.orchestrator.plan_build import build
from hpclaunch.schedulers import slurm
from hpclaunch.schedulers.local import LocalScheduler
from hpclaunch.schedulers.nodes import rendezvous_address
from hpclaunch.schedulers.pbs import node_context_from_env as pbs_context
from hpclaunch.schedulers.pbs import read_pbs_nodefile
from hpclaunch.schedulers.protocol import NodeContext, NodeContextError
from hpclaunch.schedulers.registry import get_scheduler


def hostnames(table: dict[str, list[str]]):  # type: ignore[no-untyped-def]
    """A stand-in for ``scontrol show hostnames`` (the real one runs in tests/cluster)."""
    return lambda nodelist: table.get(nodelist, [nodelist] if nodelist else [])


def test_slurm_multi_node_context() -> None:
    ctx = slurm.node_context_from_env(
        {
            "SLURM_JOB_ID": "42",
            "SLURM_JOB_NODELIST": "gpu[07-08]",
            "SLURM_JOB_NUM_NODES": "2",
            "SLURM_NODEID": "1",
            "SLURMD_NODENAME": "gpu08",
            "SLURM_RESTART_COUNT": "3",
            "SLURM_JOB_END_TIME": "1600",
        },
        hostnames=hostnames({"gpu[07-08]": ["gpu07", "gpu08"]}),
    )
    assert (ctx.scheduler, ctx.job_id, ctx.node_rank, ctx.num_nodes) == ("slurm", "42", 1, 2)
    assert ctx.hosts == ("gpu07", "gpu08") and ctx.head == "gpu07" and ctx.hostname == "gpu08"
    assert ctx.restart_count == 3 and ctx.attempt == "42.3"


def test_slurm_clock_takes_slurms_end_and_whole_minutes(monkeypatch: pytest.MonkeyPatch) -> None:
    """EndTime from scontrol (it restarts with every requeue) is the end; the limit is what SLURM
    applies (whole minutes), recorded in the clock; the start is SLURM's."""
    monkeypatch.setattr(slurm, "scontrol_hostnames", lambda nodelist: ["n1"])
    monkeypatch.setattr(slurm, "job_end_time", lambda job_id: 1720.0)
    plan = build(load_config(None, ["scheduler.kind=slurm", "scheduler.time_limit=90s"]), python="python3")
    env = {"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "n1", "SLURM_JOB_START_TIME": "1600"}
    ctx = slurm.SlurmScheduler().node_context(plan, env, now=1700.0)
    assert ctx.clock is not None
    assert (ctx.clock.start, ctx.clock.end, ctx.clock.limit_s) == (1600.0, 1720.0, 120.0)
    assert ctx.end_time == 1720.0
    monkeypatch.setattr(slurm, "job_end_time", lambda job_id: None)  # scontrol cannot say
    ctx = slurm.SlurmScheduler().node_context(plan, {**env, "SLURM_JOB_END_TIME": "1690"}, now=1700.0)
    assert ctx.end_time == 1690.0
    ctx = slurm.SlurmScheduler().node_context(plan, env, now=1700.0)
    assert ctx.end_time == 1600.0 + 120.0  # start + the limit SLURM applies


def test_slurm_node_list_is_expanded_by_scontrol_not_by_hand(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[list[str]] = []

    def fake_run(argv: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
        calls.append(argv)
        if argv[-1] == "n[1-2]x":  # what Slurm 22.05 answers, exit status 0 included
            return subprocess.CompletedProcess(argv, 0, "", "Invalid hostlist: n[1-2]x\n")
        return subprocess.CompletedProcess(argv, 0, "rack1-n01\nrack1-n02\nrack2-n01\nrack2-n02\n", "")

    monkeypatch.setattr(slurm.proc, "run", fake_run)
    assert slurm.scontrol_hostnames("rack[1-2]-n[01-02]") == [
        "rack1-n01",
        "rack1-n02",
        "rack2-n01",
        "rack2-n02",
    ]
    assert calls == [["scontrol", "show", "hostnames", "rack[1-2]-n[01-02]"]]
    with pytest.raises(NodeContextError, match="Invalid hostlist"):
        slurm.scontrol_hostnames("n[1-2]x")


def test_slurm_array_task_requeues_its_own_id() -> None:
    ctx = slurm.node_context_from_env(
        {
            "SLURM_JOB_ID": "57",
            "SLURM_ARRAY_JOB_ID": "55",
            "SLURM_ARRAY_TASK_ID": "2",
            "SLURM_JOB_NODELIST": "n1",
        },
        hostnames=hostnames({}),
    )
    assert ctx.job_id == "55_2" and ctx.array_task == 2


def test_slurm_multi_node_without_node_id_fails_loudly() -> None:
    with pytest.raises(NodeContextError, match="SLURM_NODEID is not set"):
        slurm.node_context_from_env(
            {"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_NUM_NODES": "2"},
            hostnames=hostnames({"n[1-2]": ["n1", "n2"]}),
        )


def test_pbs_nodefile_is_deduplicated_in_order(tmp_path: Path) -> None:
    nodefile = tmp_path / "nodes"
    nodefile.write_text("c1\nc1\nc1\nc2\nc2\nc3\n")
    assert read_pbs_nodefile(str(nodefile)) == ["c1", "c2", "c3"]
    ctx = pbs_context({"PBS_JOBID": "9.server", "PBS_NODEFILE": str(nodefile), "PMI_RANK": "2"})
    assert (ctx.scheduler, ctx.num_nodes, ctx.node_rank, ctx.hostname, ctx.head) == ("pbs", 3, 2, "c3", "c1")


def test_pbs_without_nodefile_runs_one_node_on_this_host() -> None:
    ctx = pbs_context({"PBS_JOBID": "12", "PBS_ARRAY_INDEX": "1"})
    assert ctx.num_nodes == 1 and ctx.node_rank == 0 and ctx.array_task == 1


def test_pbs_cannot_tell_which_node_fails(tmp_path: Path) -> None:
    nodefile = tmp_path / "nodes"
    nodefile.write_text("c1\nc2\n")
    with pytest.raises(NodeContextError, match="cannot tell which of the 2 PBS nodes"):
        pbs_context({"PBS_JOBID": "9", "PBS_NODEFILE": str(nodefile)})
    with pytest.raises(NodeContextError, match="PBS_JOBID is not set"):
        pbs_context({"SLURM_JOB_ID": "1"})


def test_local_context_uses_controller_variables() -> None:
    plan = build(RunConfig(), python="python3")
    ctx = LocalScheduler().node_context(
        plan,
        {"HPCLAUNCH_JOB_ID": "local77", "HPCLAUNCH_RESTART_COUNT": "2", "HPCLAUNCH_JOB_START_TIME": "123.5"},
        now=0.0,
    )
    assert (ctx.scheduler, ctx.job_id, ctx.restart_count) == ("local", "local77", 2)
    assert ctx.end_time == 123.5 + plan.time_limit_s
    foreground = LocalScheduler().node_context(plan, {}, now=0.0)
    assert foreground.clock is None and foreground.end_time is None  # `hpclaunch train`: no limit


def test_multi_node_head_on_loopback_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(slurm, "slurm_node_addr", lambda node, timeout=10.0: None)
    sched = get_scheduler("slurm")
    ctx = NodeContext(
        scheduler="slurm",
        job_id="1",
        node_rank=0,
        num_nodes=2,
        hostname="localhost",
        hosts=("localhost", "other"),
    )
    with pytest.raises(NodeContextError, match="loopback"):
        rendezvous_address(ctx, sched)
    one = NodeContext(
        scheduler="slurm", job_id="1", node_rank=0, num_nodes=1, hostname="localhost", hosts=("localhost",)
    )
    assert rendezvous_address(one, sched) == "127.0.0.1"  # fine when nobody else must reach it


def test_the_plans_scheduler_reads_its_own_variables() -> None:
    """Slurm's Torque emulation sets SLURM_* and PBS_* at once: a PBS plan reads the PBS side."""
    environ = {"SLURM_JOB_ID": "26", "SLURM_JOB_NODELIST": "vm", "PBS_JOBID": "26"}
    assert slurm.node_context_from_env(environ, hostnames=hostnames({})).scheduler == "slurm"
    assert pbs_context(environ).scheduler == "pbs"
