"""The PBS scheduler's allocation-side answers with PBS's JSON faked (tests/pbs runs them for real):
what a SIGTERM was, whether PBS reruns the job itself, and how a continuation avoids a node."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hpclaunch.config import load_config
from hpclaunch.errors import SchedulerError
from hpclaunch.orchestrator.launch import array_task_id, prepare
from hpclaunch.rundir.clock import AttemptClock
from hpclaunch.schedulers import pbs
from hpclaunch.schedulers.pbs_json import parse_jobs
from hpclaunch.schedulers.protocol import NodeContext

pytestmark = pytest.mark.fast

DATA = Path(__file__).parent / "pbs_records"


def job(**attrs: Any) -> pbs.pbs_json.PbsJob:
    data = json.loads((DATA / "running.json").read_text())
    (record,) = data["Jobs"].values()
    record.update(attrs)
    (parsed,) = parse_jobs(json.dumps(data)).values()
    return parsed


def ctx(end_time: float = 1000.0, array_task: int | None = None) -> NodeContext:
    clock = AttemptClock.build(
        start=end_time - 600,
        limit_s=600,
        scheduler_end=None,
        warn_lead_s=60,
        stop_lead_fixed_s=None,
        margin_s=10,
        save_estimate_s=2,
    )
    return NodeContext("pbs", "39.pbshead", 0, 1, "pbshead", ("pbshead",), clock=clock, array_task=array_task)


def plan(*overrides: str) -> Any:
    return prepare(load_config(None, ["scheduler.kind=pbs", "run_dir=/runs/x", *overrides])).plan


@pytest.mark.parametrize(
    ("record", "now", "cause"),
    [
        ({"substate": 60}, 10.0, "preemption"),  # qrerun / a requeueing preemption
        (
            {"comment": "Job run at Mon Nov 23 at 01:50 on (pbsn1:ncpus=1) and terminated by root@pbshead"},
            10.0,
            "cancelled",
        ),
        ({}, 999.5, "timeout"),  # at the walltime
        ({}, 10.0, "preemption"),  # no record of why: the scheduler took the nodes
        (None, 10.0, "preemption"),  # PBS without JSON (Torque): the clock alone
    ],
)
def test_what_a_sigterm_was(
    monkeypatch: pytest.MonkeyPatch, record: dict[str, Any] | None, now: float, cause: str
) -> None:
    monkeypatch.setattr(pbs, "own_job", lambda job_id: None if record is None else job(**record))
    assert pbs.PbsScheduler().termination_cause(Path("/runs/x"), ctx(), now=now) == cause  # type: ignore[arg-type]


def test_a_rerun_job_comes_back_by_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pbs, "own_job", lambda job_id: job(substate=61))
    monkeypatch.setattr(pbs, "qsub", lambda *a, **k: pytest.fail("nothing may be submitted"))
    cont = pbs.PbsScheduler().continue_job(plan(), plan().paths(), ctx())
    assert (cont.job_id, cont.by) == ("39.pbshead", "scheduler")


def test_select_names_hosts_when_the_plan_pins_them() -> None:
    p = plan("scheduler.nodes=2", "scheduler.gpus_per_node=2", "scheduler.cpus_per_node=2")
    assert pbs.select_spec(p, None) == "2:ncpus=2:ngpus=2:mpiprocs=1"
    pinned = p.model_copy(update={"hosts": ["pbsn2", "pbsn3"]})
    assert pbs.select_spec(pinned, "8gb") == (
        "1:ncpus=2:ngpus=2:mem=8gb:mpiprocs=1:host=pbsn2+1:ncpus=2:ngpus=2:mem=8gb:mpiprocs=1:host=pbsn3"
    )
    assert "#PBS -l select=1:ncpus=2:ngpus=2:mpiprocs=1:host=pbsn2+" in pbs.render_pbs(pinned).text


def nodes_json(*nodes: tuple[str, str, int]) -> str:
    return json.dumps(
        {
            "nodes": {
                name: {"state": state, "resources_available": {"host": name, "ncpus": 8, "ngpus": gpus}}
                for name, state, gpus in nodes
            }
        }
    )


def test_healthy_hosts_are_picked_free_first(monkeypatch: pytest.MonkeyPatch) -> None:
    listing = nodes_json(("n1", "free", 2), ("n2", "job-busy", 2), ("n3", "free", 2), ("n4", "offline", 2))
    monkeypatch.setattr(pbs, "_run", lambda argv, **k: listing)
    assert pbs.pick_hosts(plan("scheduler.nodes=2"), ["n1"]) == ["n3", "n2"]


def test_where_a_node_cannot_be_avoided_the_reason_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pbs, "_run", lambda argv, **k: nodes_json(("n1", "free", 2), ("n2", "free", 0)))
    with pytest.raises(
        SchedulerError, match=r"cannot keep this run off n1: the job needs 1 other usable node"
    ):
        pbs.pick_hosts(plan("scheduler.gpus_per_node=2"), ["n1"])
    torque = plan("scheduler.pbs_dialect=torque")
    with pytest.raises(SchedulerError, match=r"PBS \(torque dialect\) cannot keep a job off n1"):
        pbs.PbsScheduler().exclude_nodes(torque, torque.paths(), ctx(), ["n1"])


def test_array_task_ids() -> None:
    assert array_task_id("pbs", "12[].pbshead", 3) == "12[3].pbshead"
    assert array_task_id("slurm", "12", 3) == "12_3"
    assert array_task_id("pbs", "12", 1) == "12[1]"  # Slurm's Torque emulation answers a bare number


def test_kill_grace_is_the_queue_kill_delay(monkeypatch: pytest.MonkeyPatch) -> None:
    queues = (DATA / "queues.json").read_text()

    class Done:
        returncode, stdout = 0, queues

    monkeypatch.setenv("PBS_JOBID", "39.pbshead")
    monkeypatch.setattr(pbs, "own_job", lambda job_id: job(queue="short"))
    monkeypatch.setattr(pbs.proc, "run", lambda *a, **k: Done())
    assert pbs.PbsScheduler().kill_grace_s(plan()) == 1.0
    monkeypatch.setattr(pbs, "own_job", lambda job_id: None)
    assert pbs.PbsScheduler().kill_grace_s(plan()) == 10.0  # no queue known: PBS's default
