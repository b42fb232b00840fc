"""The node agent's parts that left ``jobs/agent.py`` (issue 27): admission, the records of a
decision, carrying it out, what the rank host is handed, the decider's role and the watch over an
attempt. Each is driven here without an agent."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from tests.runlib import wait_for

from hpclaunch.config import RunConfig, load_config
from hpclaunch.errors import HpclaunchError
from hpclaunch.jobs.admission import admit
from hpclaunch.jobs.agent_records import decision_fields, scheduler_note, started_fields
from hpclaunch.jobs.allocation import Roster, node_ranks
from hpclaunch.jobs.attempt_env import attempt_env, rank_host_environment, rank_request
from hpclaunch.jobs.attempt_facts import in_place_ok, started_at
from hpclaunch.jobs.carry_out import cancelled_meanwhile, carry_out
from hpclaunch.jobs.decider import Decider
from hpclaunch.jobs.decider_role import DeciderRole
from hpclaunch.jobs.decision_rules import Action, Decision
from hpclaunch.jobs.node_run import NodeRun
from hpclaunch.jobs.watching import AttemptWatch
from hpclaunch.orchestrator.plan_build import build
from hpclaunch.rundir import Ledger, RunLock, RunPaths, read_events
from hpclaunch.rundir.cause import Budget, Cause
from hpclaunch.rundir.env import ATTEMPT_VAR, PRELOAD_COMPILE_VAR, PROGRESS_DIR_VAR
from hpclaunch.rundir.events import as_events
from hpclaunch.rundir.node_dir import NodeDir
from hpclaunch.rundir.outcome import AttemptOutcome, reached_step
from hpclaunch.schedulers.protocol import Continuation, NodeContext

pytestmark = pytest.mark.fast

HOSTS = ("n1", "n2", "n3")
CONTINUE = Decision(Action.CONTINUE, Cause.TIMEOUT, "the time limit", counts_as=Budget.REQUEUE)


def ctx(scheduler: str = "local", job: str = "7", rank: int = 0) -> NodeContext:
    return NodeContext(scheduler, job, rank, len(HOSTS), HOSTS[rank], HOSTS)


# ---- records --------------------------------------------------------------------------------------


def test_a_continuation_records_who_continued_what_it_spent_and_what_it_resumes_from() -> None:
    assert scheduler_note(CONTINUE, scheduler="slurm", can_exclude_nodes=True) is None
    fields = decision_fields(
        CONTINUE,
        step=40,
        newest_checkpoint=30,
        job_id="8",
        by="scheduler",
    )
    assert (fields["step"], fields["job_id"], fields["by"], fields["checkpoint"]) == (
        40,
        "8",
        "scheduler",
        30,
    )
    assert fields["counts_as"] == "requeue" and fields["in_place"] is False


def test_an_end_records_no_continuation_fields_and_says_what_the_scheduler_cannot_do() -> None:
    fail = Decision(Action.FAIL, Cause.NODE_FAILURE, "n2 died")
    note = scheduler_note(fail, scheduler="pbs", can_exclude_nodes=False)
    fields = decision_fields(fail, newest_checkpoint=30, note=note or "")
    assert "by" not in fields and "checkpoint" not in fields and fields["error"] == "n2 died"
    assert fields["note"] == "pbs cannot keep a continuation off a node"
    hang = Decision(Action.CONTINUE, Cause.HANG, "rank 3 hung", counts_as=Budget.HANG)
    assert "may run where it hung" in str(scheduler_note(hang, scheduler="local", can_exclude_nodes=False))
    assert scheduler_note(hang, scheduler="slurm", can_exclude_nodes=True) is None
    assert "note" not in decision_fields(hang)


def test_an_in_place_start_records_its_roster_and_the_attempt_it_follows() -> None:
    plan = build(RunConfig(), python="python3")
    first = started_fields(ctx(), plan)
    assert first["hosts"] == list(HOSTS) and "in_place" not in first
    later = started_fields(ctx(), plan, roster=Roster(("n3", "n2"), ()), previous="7.0")
    assert (
        later["in_place"] is True
        and later["previous"] == "7.0"
        and later["roster"]["training"] == ["n3", "n2"]
    )


# ---- carrying a decision out ----------------------------------------------------------------------


class Continuations:
    """A scheduler's continuation calls (what the local scheduler would do, counted or refused)."""

    can_exclude_nodes = True

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.asked: list[str] = []

    def continue_job(self, plan: Any, paths: Any, ctx: Any) -> Any:
        self.asked.append("continue")
        if self.fail:
            raise HpclaunchError("sbatch: error: Batch job submission failed")
        return Continuation("8", by="scheduler")

    def exclude_nodes(self, plan: Any, paths: Any, ctx: Any, nodes: list[str]) -> Any:
        self.asked.append(f"exclude {nodes}")
        return Continuation("9")


def _node(tmp_path: Path, scheduler: Any, rank: int = 0) -> NodeRun:
    """Node ``rank``'s run as its agent starts it (a fake scheduler)."""
    return NodeRun.start(RunPaths(tmp_path), build(RunConfig(), python="python3"), ctx(rank=rank), scheduler)


def _carry(
    tmp_path: Path, decision: Decision, scheduler: Continuations, recheck: Any = None
) -> tuple[int, list, list]:
    recorded: list[tuple[Decision, dict[str, Any]]] = []
    released: list[str | None] = []
    code = carry_out(
        decision,
        _node(tmp_path, scheduler),
        recheck=recheck or (lambda d: d),
        record=lambda d, **kw: recorded.append((d, kw)),
        release=released.append,
    )
    return code, recorded, released


def test_a_continuation_hands_the_lock_to_the_job_that_continues(tmp_path: Path) -> None:
    code, recorded, released = _carry(tmp_path, CONTINUE, Continuations())
    assert code == 0 and released == ["8"] and recorded == [(CONTINUE, {"job_id": "8", "by": "scheduler"})]
    exclude = Decision(Action.EXCLUDE, Cause.NODE_FAILURE, "n2 died", exclude=("n2",))
    scheduler = Continuations()
    assert _carry(tmp_path, exclude, scheduler)[2] == ["9"] and scheduler.asked == ["exclude ['n2']"]
    assert [
        e["nodes"]
        for e in [e.record for e in read_events(RunPaths(tmp_path)).events]
        if e["event"] == "node_excluded"
    ] == [["n2"]]


def test_a_continuation_the_scheduler_refuses_ends_the_run_resumable_and_releases_the_lock(
    tmp_path: Path,
) -> None:
    """Never FAILED for the scheduler's refusal (issue 49, M1: tests/unit/test_continue_patiently.py)."""
    code, recorded, released = _carry(tmp_path, CONTINUE, Continuations(fail=True))
    assert code == 1 and released == [None]
    ((ended, _),) = recorded
    assert (
        ended.action is Action.END
        and "continuing through the scheduler failed (sbatch: error" in ended.reason
    )
    assert "submit --resume" in ended.reason


def test_a_cancellation_while_the_continuation_was_asked_for_is_a_cancellation(tmp_path: Path) -> None:
    calls = iter([False, True])  # not cancelled before the call; cancelled when it failed

    def recheck(d: Decision) -> Decision:
        return cancelled_meanwhile(d, signalled=next(calls), events=[], started_at=0.0)

    code, recorded, released = _carry(tmp_path, CONTINUE, Continuations(fail=True), recheck)
    assert code == 0 and released == [None] and recorded[0][0].cause is Cause.CANCELLED


def test_a_cancel_recorded_since_the_attempt_started_turns_a_continuation_into_an_end() -> None:
    old = [{"event": "cancelled", "ts": 5.0}]
    assert cancelled_meanwhile(CONTINUE, signalled=False, events=as_events(old), started_at=10.0) is CONTINUE
    new = [{"event": "cancelled", "ts": 12.0}]
    ended = cancelled_meanwhile(CONTINUE, signalled=False, events=as_events(new), started_at=10.0)
    assert (ended.action, ended.cause) == (Action.END, Cause.CANCELLED)
    fail = Decision(Action.FAIL, Cause.CRASH, "boom")
    assert cancelled_meanwhile(fail, signalled=True, events=as_events(new), started_at=0.0) is fail


# ---- admission (node 0) ------------------------------------------------------------------------------------


class Withdrawals:
    can_exclude_nodes = True

    def withdraw(self, paths: Any, ctx: Any) -> str:
        return "job 7 withdrawn"


def _admit(tmp_path: Path, job: str = "7") -> tuple[Any, list[tuple[Decision, dict[str, Any]]]]:
    paths = RunPaths(tmp_path)
    recorded: list[tuple[Decision, dict[str, Any]]] = []
    node = NodeRun.start(paths, build(RunConfig(), python="python3"), ctx(job=job), Withdrawals())  # type: ignore[arg-type]
    admission = admit(
        node,
        lock=RunLock(paths),
        record=lambda d, **kw: recorded.append((d, kw)),
    )
    return admission, recorded


def test_a_free_run_is_admitted_and_its_lock_taken_by_this_job(tmp_path: Path) -> None:
    admission, recorded = _admit(tmp_path)
    assert admission.refusal is None and admission.holder is not None and admission.holder.job_id == "7"
    assert RunLock(RunPaths(tmp_path)).read().job_id == "7" and recorded == []


def test_an_ended_run_is_withdrawn_untouched(tmp_path: Path) -> None:
    Ledger(RunPaths(tmp_path), role="agent").append("finished", step=100)
    admission, recorded = _admit(tmp_path)
    assert admission.refusal is not None and admission.holder is None
    assert recorded[0][1] == {"note": "job 7 withdrawn"} and RunLock(RunPaths(tmp_path)).read() is None


def test_an_attempt_nobody_decided_is_decided_once_as_the_preemption_it_was(tmp_path: Path) -> None:
    ledger = Ledger(RunPaths(tmp_path), role="agent", attempt="6.0", node=0)
    ledger.append("started", job_id="6", restart_count=0)  # its agents were killed before deciding
    admission, recorded = _admit(tmp_path)
    assert admission.refusal is None
    ((decision, fields),) = recorded
    assert (
        decision.action is Action.CONTINUE
        and fields["by"] == "scheduler"
        and fields["ledger"].attempt == "6.0"
    )


def test_the_rank_request_names_the_rosters_first_node_as_the_rendezvous_host(tmp_path: Path) -> None:
    cfg = load_config(None, ["scheduler.kind=slurm", "scheduler.nodes=2"])
    plan = build(cfg, python="python3")
    paths = RunPaths(tmp_path)

    class Nodes:
        def node_address(self, host: str) -> str:
            return {"n1": "10.0.0.1", "n2": "10.0.0.2", "n3": "10.0.0.3"}[host]

    def request_of(rank: int) -> dict[str, Any]:
        roster = Roster(("n3", "n2"), ())
        node = NodeRun.start(paths, plan, ctx(rank=rank), Nodes())  # type: ignore[arg-type]
        return rank_request(node, roster)

    request = request_of(1)
    assert request["nnodes"] == 2 and request["env"][ATTEMPT_VAR] == ctx(rank=1).attempt
    assert request["rdzv_configs"]["is_host"] is False and request["local_addr"] == "10.0.0.2"
    assert request["rdzv_endpoint"].startswith("10.0.0.3:")  # the roster's first node hosts it, not node 0
    host = request_of(2)
    assert host["rdzv_configs"]["is_host"] is True
    node_tmp = tmp_path / "node-tmp"
    node_tmp.mkdir()
    node = NodeDir.prepare(tmp=node_tmp)
    env = attempt_env("7.1", plan, ctx(), paths, node)  # no clock, gloo: its key, its heartbeats' folder
    assert env[ATTEMPT_VAR] == "7.1" and set(env) == {ATTEMPT_VAR, PROGRESS_DIR_VAR}
    assert Path(env[PROGRESS_DIR_VAR]).is_dir() and Path(env[PROGRESS_DIR_VAR]).is_relative_to(node.path)
    # in an image: the same folder below the node directory's place there (/tmp/<its name>)
    in_image = NodeDir.prepare(tmp=node_tmp, in_image=True)
    seen = attempt_env("7.1", plan, ctx(), paths, in_image)[PROGRESS_DIR_VAR]
    assert Path(seen) == Path("/tmp", node.path.name) / Path(env[PROGRESS_DIR_VAR]).relative_to(node.path)
    # no node directory shared with the ranks: they report in the run directory, as without an agent
    assert set(attempt_env("7.1", plan, ctx(), paths)) == {ATTEMPT_VAR}


def test_the_agent_takes_its_settings_from_the_plan_alone(tmp_path: Path) -> None:
    """Issue 47: the agent read the plan and the config and mixed them. Now the plan's agent part
    (made from the config at submit) is its one source: no ``config.yaml`` here, and it runs."""
    cfg = load_config(None, ["scheduler.kind=slurm", "scheduler.nodes=2", "launch.rdzv_port=29123"])
    cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"compile": True})})
    plan = build(cfg, python="python3")
    paths = RunPaths(tmp_path)
    assert not paths.config.exists()
    node = NodeRun.start(paths, plan, ctx(rank=1), Addresses())  # type: ignore[arg-type]
    request = rank_request(node, Roster(("n1", "n2"), ()))
    assert request["rdzv_endpoint"] == "10.0.0.1:29123" and request["program"] == "mmdit"
    assert rank_host_environment(node)[PRELOAD_COMPILE_VAR] == "cpu"  # train.compile, on gloo


def test_the_nccl_preset_sits_under_the_runs_own_values_on_the_node_as_at_submit(tmp_path: Path) -> None:
    """A named preset's variables are in the plan's environment already, under ``nccl.env`` and
    ``launch.env``; the node added the preset again on top, so the run's own value lost there."""
    cfg = load_config(
        None,
        [
            "scheduler.kind=slurm",
            "scheduler.gpus_per_node=1",
            "nccl.preset=ethernet",
            "launch.env={NCCL_IB_DISABLE: '0'}",
        ],
    )
    plan = build(cfg, python="python3", nccl_env={"NCCL_IB_DISABLE": "1", "NCCL_SOCKET_IFNAME": "^lo"})
    assert plan.backend == "nccl" and plan.env["NCCL_IB_DISABLE"] == "0"
    node = NodeRun.start(RunPaths(tmp_path), plan, ctx(), Addresses())  # type: ignore[arg-type]
    env = rank_host_environment(node)
    assert env["NCCL_IB_DISABLE"] == "0" and env["NCCL_SOCKET_IFNAME"] == "^lo"
    (record,) = [e.record for e in read_events(RunPaths(tmp_path)).named("nccl_preset")]
    assert record["preset"] == "ethernet" and record["env"]["NCCL_IB_DISABLE"] == "0"
    assert "overrides NCCL_IB_DISABLE" in record["reason"]


class Addresses:
    def node_address(self, host: str) -> str:
        return {"n1": "10.0.0.1", "n2": "10.0.0.2", "n3": "10.0.0.3"}[host]


# ---- the decider's role ---------------------------------------------------------------------------


class Relay:
    """What the decider reads of the stop relay: no stop, no cancel (unless told)."""

    def __init__(self, cancelled: bool = False) -> None:
        self.cancelled = cancelled
        self.stop_cause = None
        self.interrupted = None
        self.lead = False
        self.polls = 0

    def handle_signals(self) -> None:
        self.polls += 1

    def cut_off_if_due(self, now: float) -> None: ...


def _decider(tmp_path: Path, rank: int = 0, relay: Relay | None = None) -> Decider:
    paths = RunPaths(tmp_path)
    if RunLock(paths).read() is None:  # node 0's agent adopted the run lock at its admission
        RunLock(paths).adopt(job_id="7", role="agent")
    return Decider(DeciderRole(_node(tmp_path, Continuations(), rank), relay or Relay()))  # type: ignore[arg-type]


def test_another_attempt_in_place_needs_no_stop_under_way_and_time_for_a_start_and_a_save() -> None:
    plan = build(RunConfig(), python="python3")  # restart_in_place, a stop lead of about 13 s
    assert in_place_ok(plan, stopping=False, end_time=None, now=0.0)
    assert not in_place_ok(plan, stopping=True, end_time=None, now=0.0)
    assert in_place_ok(plan, stopping=False, end_time=1000.0, now=900.0)
    assert not in_place_ok(plan, stopping=False, end_time=1000.0, now=950.0)  # under a minute left


def test_an_attempt_started_when_its_started_event_says_and_node_ranks_follow_the_allocation() -> None:
    events = [
        {"event": "started", "attempt": "7.0", "ts": 3.0},
        {"event": "started", "attempt": "7.1", "ts": 9.0},
    ]
    assert started_at(as_events(events), "7.1") == 9.0 and started_at(as_events(events), "8.0") == 0.0
    assert node_ranks(HOSTS, ("n3", "n1", "elsewhere")) == {2: "n3", 0: "n1"}


def test_one_decision_per_attempt_a_second_decider_follows_the_first(tmp_path: Path) -> None:
    first, second = _decider(tmp_path, 0), _decider(tmp_path, 1)
    in_place = Decision(Action.CONTINUE, Cause.CRASH, "n2 crashed", in_place=True, replace=(("n2", "n3"),))
    record = first.publish(in_place, Roster(("n1", "n2"), ("n3",)))
    assert record["next"] == "7.0.1" and record["roster"]["training"] == ["n1", "n3"] and record["by"] == "n1"
    assert second.publish(Decision(Action.FAIL, Cause.CRASH, "boom"), Roster(("n1", "n2"))) == record
    assert [e.record["spare"] for e in read_events(RunPaths(tmp_path)).named("node_replaced")] == ["n3"]
    follower = _decider(tmp_path, 2)
    assert follower.role.await_decision(Roster(("n1", "n3"))) == record


def test_taking_the_role_over_takes_the_run_lock_and_the_relays_lead(tmp_path: Path) -> None:
    relay = Relay()
    decider = _decider(tmp_path, 1, relay)
    assert not decider.role.leads
    decider.role.take_over()
    assert (
        decider.role.leads
        and relay.lead
        and decider.role.holder is not None
        and decider.role.holder.job_id == "7"
    )
    decider.node.alloc.beats.mkdir(parents=True)
    decider.node.alloc.beat()  # n2 beats; a roster whose first live agent is n2 keeps the role here
    decider.role.follow(Roster(("n2",)))
    decider.node.alloc.stop_beating()
    assert decider.role.leads
    assert decider.role.await_decision(Roster(("n2",))) is None  # it decides: nothing to wait for
    decider.role.close()


def test_an_agent_that_took_the_role_over_keeps_the_run_lock_alive(tmp_path: Path) -> None:
    decider = _decider(tmp_path, 1)
    decider.role.beat_every_s = 0.01
    decider.role.take_over()
    assert decider.role.holder is not None
    adopted = decider.role.holder.heartbeat
    holder = decider.role.holder
    wait_for(
        lambda: (decider.role.lock.read() or holder).heartbeat > adopted,
        timeout=60,
        poll=0.01,
        what="a heartbeat",
    )
    decider.role.close()


def test_a_cancel_since_the_attempt_started_and_a_stuck_node_are_the_decisions_facts(tmp_path: Path) -> None:
    decider = _decider(tmp_path)
    decider.ledger.append("started", job_id="7")
    decider.ledger.append("cancelled")
    decision = decider.after_attempt(1, Roster(("n1", "n2")), stuck=("n2",))
    assert decision.cause is Cause.CANCELLED and decision.action is not Action.CONTINUE
    (hang,) = [e.record for e in read_events(RunPaths(tmp_path)).named("hang")]
    assert "n2" in json.dumps(hang)


def test_a_decision_without_an_outcome_records_the_furthest_step_the_ranks_completed(tmp_path: Path) -> None:
    """A hang leaves no outcome: the decision's step is what the ranks' heartbeats say (rank 1 hung
    inside step 31, rank 0 waits in its reduction: 30 completed), so status counts steps 1-30 as
    computed (it counted them lost when the step was missing and no line had logged them)."""
    decider = _decider(tmp_path)
    folder = decider.node.paths.attempt_dir(decider.node.attempt)
    folder.mkdir(parents=True, exist_ok=True)
    for rank, phase in ((0, "collective"), (1, "compute")):
        beat = {"rank": rank, "node": "n1", "step": 31, "phase": phase, "phase_since": 1.0, "updated": 2.0}
        (folder / f"rank{rank}.progress.json").write_text(json.dumps(beat))
    decision = decider.after_attempt(1, Roster(("n1", "n2")), stuck=("n2",))
    decider.record(decision, fence=False)
    (decided,) = read_events(RunPaths(tmp_path)).named(decision.event)
    assert decided.record["step"] == 30


def test_the_step_reached_is_the_furthest_of_the_outcome_and_the_heartbeats(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path)
    folder = paths.attempt_dir("7.0")
    assert reached_step(paths, "7.0", None) is None  # nothing known
    assert reached_step(paths, "7.0", AttemptOutcome("failed", Cause.CRASH, 46)) == 46
    folder.mkdir(parents=True)
    beat = {"rank": 0, "node": "n1", "step": 48, "phase": "data", "phase_since": 1.0, "updated": 2.0}
    (folder / "rank0.progress.json").write_text(json.dumps(beat))
    # rank 0 began step 48 (47 done); the rank that reported was stopped by its launcher at 46
    assert reached_step(paths, "7.0", AttemptOutcome("failed", Cause.CRASH, 46)) == 47
    # a stop's step is the one every rank agreed on: no heartbeat is read
    assert reached_step(paths, "7.0", AttemptOutcome("stopped", Cause.TIMEOUT, 44)) == 44


# ---- the watch over an attempt ----------------------------------------------------------------------


def test_the_watch_looks_for_the_end_file_once_per_look_and_takes_over_from_a_gone_decider(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    relay = Relay()
    decider = _decider(tmp_path, 1, relay)
    watch = AttemptWatch(
        decider.node,
        relay=relay,  # type: ignore[arg-type]
        role=decider.role,
        roster=Roster(("n2", "n1")),  # n2 first in roster order: the role is n2's once it beats
        watchdog=False,
    )
    now = [100.0]
    monkeypatch.setattr("hpclaunch.jobs.watching.time.monotonic", lambda: now[0])
    monkeypatch.setattr("hpclaunch.jobs.decider_role.time.monotonic", lambda: now[0])
    assert not watch.ended()
    decider.node.alloc.signal_end("7.0", "node n3: failed")
    assert not watch.ended()  # not looked at again before LOOK_S
    now[0] += 5.0
    assert watch.ended()
    decider.node.alloc.beats.mkdir(parents=True)
    decider.node.alloc.beat()  # the deciding agent (node 0's) is not n2: n2 is the first live one, it takes over
    watch.poll(list)
    decider.node.alloc.stop_beating()
    assert relay.polls == 1 and decider.role.leads and relay.lead and watch.hang is None
