"""A decider in a process of its own, for ``test_fencing.py``: node 0's agent of job 7 on n1, which
decides to continue its attempt without n2 and stops itself (SIGSTOP: a real pause, as a GC pause
or a hung NFS client makes one) at a given point of the way; the test resumes it (SIGCONT) after
another decider took the role over.

    python -m tests.unit.fencing_child RUN_DIR POINT

POINT: ``before-publish`` (decided, not published), ``before-carry-out`` (published, not yet carried
out), ``after-submit`` (its continuation job submitted, not recorded). What it ends with goes to
``RUN_DIR/child.json``; the scheduler calls both deciders make go to ``RUN_DIR/calls.jsonl``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

from hpclaunch.config import RunConfig
from hpclaunch.jobs.allocation import Roster
from hpclaunch.jobs.decider import Decider
from hpclaunch.jobs.decider_role import DeciderRole
from hpclaunch.jobs.decision_rules import Action, Decision
from hpclaunch.jobs.node_run import NodeRun
from hpclaunch.orchestrator.plan_build import build
from hpclaunch.rundir import RunLock, RunPaths
from hpclaunch.rundir.cause import Budget, Cause
from hpclaunch.schedulers.protocol import Continuation, NodeContext

HOSTS = ("n1", "n2", "n3")
ROSTER = Roster(("n1", "n2"), ())
EXCLUDE = Decision(
    Action.EXCLUDE,
    Cause.NODE_FAILURE,
    "n2: its agent and ranks are gone; continuing without n2",
    exclude=("n2",),
    counts_as=Budget.NODE,
)


def pause(point: str, at: str) -> None:
    if point == at:
        (Path(os.environ["FENCING_RUN"]) / f"paused-{os.getpid()}").write_text(at)
        os.kill(os.getpid(), signal.SIGSTOP)


class FakeScheduler:
    """SLURM's part, which this unit test cannot run: every call is written to ``calls.jsonl``."""

    can_exclude_nodes = True

    def __init__(self, run: Path, point: str = "") -> None:
        self.calls = run / "calls.jsonl"
        self.point = point

    def _call(self, **fields: Any) -> None:
        with open(self.calls, "a") as f:
            f.write(json.dumps({"pid": os.getpid(), **fields}) + "\n")

    def exclude_nodes(self, plan: Any, paths: Any, ctx: Any, nodes: list[str]) -> Continuation:
        job = f"cont-{os.getpid()}"
        self._call(call="exclude_nodes", job=job, nodes=nodes)
        pause(self.point, "after-submit")
        return Continuation(job)

    def cancel(self, paths: Any, job_id: str) -> None:
        self._call(call="cancel", job=job_id)


def decider(run: Path, rank: int, scheduler: FakeScheduler) -> Decider:
    paths = RunPaths(run)
    ctx = NodeContext("slurm", "7", rank, len(HOSTS), HOSTS[rank], HOSTS)
    relay = type("Relay", (), {"cancelled": False, "stop_cause": None, "interrupted": None, "lead": False})()
    relay.handle_signals = lambda: None  # type: ignore[attr-defined]
    node = NodeRun.start(paths, build(RunConfig(), python=sys.executable), ctx, scheduler)  # type: ignore[arg-type]
    return Decider(DeciderRole(node, relay))  # type: ignore[arg-type]


def main() -> None:
    run, point = Path(sys.argv[1]), sys.argv[2]
    os.environ["FENCING_RUN"] = str(run)
    d = decider(run, 0, FakeScheduler(run, point))
    d.role.hold(RunLock(d.node.paths).adopt(job_id="7", role="agent"))  # node 0's admission
    d.role.beat_every_s = 3600.0
    (run / "admitted").write_text(str(os.getpid()))
    real_publish, real_carry_out = d.node.alloc.publish, d.carry_out

    def publish(attempt: str, record: Any) -> bool:
        pause(point, "before-publish")
        return real_publish(attempt, record)

    def carry_out(decision: Decision) -> int:
        pause(point, "before-carry-out")
        return real_carry_out(decision)

    d.node.alloc.publish = publish  # type: ignore[method-assign]
    d.carry_out = carry_out  # type: ignore[method-assign]
    d.fenced_at_start = d.role.fenced()  # type: ignore[attr-defined]
    record = d.publish(EXCLUDE, ROSTER)
    d.role.close()
    (run / "child.json").write_text(json.dumps({"record": record, "leads": d.role.leads}))


if __name__ == "__main__":
    main()
