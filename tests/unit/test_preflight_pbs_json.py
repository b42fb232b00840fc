"""The scheduler check on PBS Pro / OpenPBS JSON (captured from the real OpenPBS of
scripts/local-pbs, tests/unit/pbs_records), with the tools faked; tests/pbs runs it against the server."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from hpclaunch.config import RunConfig
from hpclaunch.preflight.check_context import CheckContext, CommandResult, Status
from hpclaunch.preflight.probe import StaticProbe
from hpclaunch.preflight.scheduler_check import check_scheduler

pytestmark = pytest.mark.fast

DATA = Path(__file__).parent / "pbs_records"
SCHED = 'Sched default\n    preempt_order = "SCR 80 SC"\n    scheduling = True\n'


def two_nodes(offline: str | None = None) -> str:
    data = json.loads((DATA / "nodes.json").read_text())
    head = data["nodes"].pop("pbshead")
    for i, name in enumerate(("pbsn1", "pbsn2")):
        node = json.loads(json.dumps(head))
        node["resources_available"].update(host=name, vnode=name, ngpus=4 - 2 * i)
        node["state"] = "offline" if name == offline else "free"
        data["nodes"][name] = node
    return json.dumps(data)


def ctx(
    tmp_path: Path, *, pbsnodes: str | None = None, sched_text: str = SCHED, **sched: Any
) -> CheckContext:
    outputs = {
        "qstat -Q -f -F json": (DATA / "queues.json").read_text(),
        "qstat -B -f -F json": (DATA / "server.json").read_text(),
        "pbsnodes -a -F json": pbsnodes if pbsnodes is not None else (DATA / "nodes.json").read_text(),
        "qmgr -c list sched": sched_text,
    }
    cfg = RunConfig.model_validate({"scheduler": {"kind": "pbs", **sched}}).resolved(tmp_path)

    def run(argv: Sequence[str], timeout: float) -> CommandResult | None:
        text = outputs.get(" ".join(argv))
        return None if text is None else CommandResult(0, text, "")

    return CheckContext(cfg=cfg, node=None, probe=StaticProbe(), run=run, which=lambda t: f"/opt/pbs/bin/{t}")


def test_default_queue_and_what_it_allows(tmp_path: Path) -> None:
    out = check_scheduler(ctx(tmp_path))
    assert out.status is Status.PASS
    assert out.finding == (
        "PBS 23.06.06: queue workq (default), no max walltime, kill_delay 10 s; 1 node(s) can take a chunk "
        "of select=1:ncpus=3:mpiprocs=1; reruns: the job is submitted rerunnable (-r y), preempt_order SCR 80 SC"
    )


def test_queue_limits(tmp_path: Path) -> None:
    out = check_scheduler(ctx(tmp_path, partition="short", time_limit="6m"))
    assert out.status is Status.FAIL
    assert "scheduler.time_limit 6m exceeds queue short's resources_max.walltime 00:05:00" in out.finding
    out = check_scheduler(ctx(tmp_path, partition="short", time_limit="4m"))
    assert out.status is Status.WARN
    assert "queue short's kill_delay 1 s is shorter than a checkpoint save" in out.finding
    out = check_scheduler(ctx(tmp_path, partition="wrkq"))
    assert out.finding == "queue 'wrkq' does not exist (did you mean workq?); queues: workq, short"


def test_select_against_the_nodes(tmp_path: Path) -> None:
    nodes = two_nodes()
    out = check_scheduler(ctx(tmp_path, pbsnodes=nodes, gpus_per_node=8, cpus_per_node=2))
    assert out.status is Status.FAIL
    assert out.finding.startswith("no node can take select=1:ncpus=2:ngpus=8:mpiprocs=1: ngpus 8 > pbsn1's 4")
    out = check_scheduler(ctx(tmp_path, pbsnodes=nodes, nodes=2, gpus_per_node=4, cpus_per_node=2))
    assert out.status is Status.FAIL
    assert (
        "1 node(s) can take a chunk of select=2:ncpus=2:ngpus=4:mpiprocs=1; the run asks for 2" in out.finding
    )
    out = check_scheduler(ctx(tmp_path, pbsnodes=nodes, nodes=2, gpus_per_node=2))
    assert out.status is Status.PASS, out
    out = check_scheduler(ctx(tmp_path, pbsnodes=two_nodes(offline="pbsn2"), nodes=2, gpus_per_node=2))
    assert (
        out.status is Status.WARN
        and "only 1 of the 2 node(s)" in out.finding
        and "pbsn2 offline" in out.finding
    )
    out = check_scheduler(ctx(tmp_path, pbsnodes=nodes, nodes=2, exclude=["pbsn1"]))
    assert out.status is Status.FAIL and "(outside exclude pbsn1)" in out.finding


def test_preemption_that_never_requeues_is_named(tmp_path: Path) -> None:
    out = check_scheduler(ctx(tmp_path, sched_text='Sched default\n    preempt_order = "SD"\n'))
    assert out.status is Status.WARN and "preempt_order 'SD' never requeues (R)" in out.finding
