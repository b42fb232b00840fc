"""The rescue job (issue 24, finding 4): what it decides from a ledger (pure rows), how it carries
that out against a fake scheduler (lock taken over from the dead job, continuation held until the
attempt is recorded decided), what status shows, and the scripts it is submitted as."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hpclaunch.jobs import rescue as rescue_mod
from hpclaunch.jobs.decision_rules import Action, Budgets
from hpclaunch.jobs.rescue import Rescue, Seen, find, gone_hosts
from hpclaunch.orchestrator.status import rescue_view
from hpclaunch.rundir import Ledger, LockHolder, RunLock, RunPaths
from hpclaunch.rundir.cause import Cause
from hpclaunch.rundir.events import as_events
from hpclaunch.schedulers.rescue_job import run_has_ended, waiting_rescues

BUDGETS = Budgets(max_requeues=3, max_failure_retries=1, max_node_excludes=2, max_hang_retries=3)
HOSTS = ["n1", "n2", "n3"]


def ev(kind: str, ts: float, **fields: Any) -> dict[str, Any]:
    return {"event": kind, "ts": ts, **fields}


def running(job: str = "21", attempt: str = "21.0") -> list[dict[str, Any]]:
    """A run whose job ``job`` started ``attempt`` on n1-n3 and then nothing more was heard."""
    return [
        ev("submitting", 1),
        ev("submitted", 2, job_id=job),
        ev("rescue_submitted", 3, job_id=job, rescue_job="99"),
        *[ev("started", 10 + n, attempt=attempt, node=n, job_id=job, hosts=HOSTS) for n in range(3)],
    ]


BEATS_TOGETHER = {"n1": 100.0, "n2": 100.6, "n3": 100.9}  # SLURM ended every agent at once


def test_an_undecided_attempt_is_a_node_failure_of_the_batch_host() -> None:
    found = find(
        as_events(running()), "21", budgets=BUDGETS, seen=Seen(beats=BEATS_TOGETHER, scheduler_word="FAILED")
    )
    assert found.attempt == "21.0" and found.gone == ("n1",)
    d = found.decision
    assert d is not None and (d.action, d.cause, d.exclude, d.counts_as) == (
        Action.EXCLUDE,
        Cause.NODE_FAILURE,
        ("n1",),
        "node",
    )
    assert "n1: the batch host" in d.reason and "job 21 (FAILED)" in d.reason and "without n1" in d.reason


def test_a_host_whose_agent_fell_silent_first_is_left_out_too() -> None:
    assert gone_hosts(("n1", "n2", "n3"), {"n1": 100.0, "n2": 80.0, "n3": 100.2}) == ("n1", "n2")
    # A spare (or any agent) that reported the attempt and then exited on a decision was not gone.
    assert gone_hosts(("n1", "n2", "n3"), {"n1": 100.0, "n2": 120.0, "n3": 100.2}, {"n2", "n3"}) == ("n1",)
    assert gone_hosts(("n1", "n2"), {}) == ("n1",)  # no heartbeats at all: the batch host
    assert gone_hosts((), {}) == ()


def test_a_decided_attempt_is_left_alone() -> None:
    events = [*running(), ev("requeued", 50, attempt="21.0", cause="crash", in_place=True)]
    found = find(as_events(events), "21", budgets=BUDGETS, seen=Seen(beats=BEATS_TOGETHER))
    assert found.decision is None and "was decided; nothing to do" in found.reason


def test_a_requeued_job_whose_new_attempt_was_decided_is_left_alone() -> None:
    """A requeue keeps the job id: the rescue looks at the job's latest attempt only."""
    events = [
        *running(),
        ev("requeued", 40, attempt="21.0", cause="preemption"),
        ev("started", 50, attempt="21.1", node=0, job_id="21", hosts=HOSTS),
        ev("finished", 60, attempt="21.1"),
    ]
    found = find(as_events(events), "21", budgets=BUDGETS, seen=Seen(beats=BEATS_TOGETHER))
    assert found.decision is None and found.attempt == "21.1"


def test_a_job_that_never_started_an_agent_is_left_alone() -> None:
    found = find(as_events(running()[:3]), "21", budgets=BUDGETS, seen=Seen(beats={}))
    assert found.decision is None and "before any of its agents started" in found.reason


def test_a_cancellation_ends_the_run_instead() -> None:
    """scancel of the job (the agents killed before they could record it) ends the run as cancelled;
    after `hpclaunch cancel` the run has ended already (it says so in the ledger)."""
    d = find(
        as_events(running()),
        "21",
        budgets=BUDGETS,
        seen=Seen(beats=BEATS_TOGETHER, scheduler_word="CANCELLED"),
    ).decision
    assert d is not None and (d.action, d.cause) == (Action.END, Cause.CANCELLED)
    by_ledger = [*running(), ev("cancelled", 30, by="hpclaunch cancel")]
    found = find(as_events(by_ledger), "21", budgets=BUDGETS, seen=Seen(beats=BEATS_TOGETHER))
    assert found.decision is None and "already ended (cancelled)" in found.reason


def test_a_pending_user_stop_ends_the_run_as_the_user_asked() -> None:
    d = find(
        as_events(running()), "21", budgets=BUDGETS, seen=Seen(beats=BEATS_TOGETHER, user_stop=True)
    ).decision
    assert d is not None and (d.action, d.cause) == (Action.END, Cause.USER)


def test_the_node_budget_is_kept() -> None:
    spent = [
        *running(),
        ev("node_excluded", 20, nodes=["n7"]),
        ev("node_replaced", 21, nodes=["n8"], spare="n3"),
    ]
    d = find(as_events(spent), "21", budgets=BUDGETS, seen=Seen(beats=BEATS_TOGETHER)).decision
    assert d is not None and (d.action, d.cause) == (Action.FAIL, Cause.NODE_FAILURE)
    assert "2 node exclusions used of 2" in d.reason


def test_rescues_wait_until_withdrawn_and_the_run_ends_for_good() -> None:
    events = running()
    assert waiting_rescues(as_events(events)) == ["99"] and not run_has_ended(as_events(events))
    assert waiting_rescues(as_events(events), own="99") == []
    ended = [*events, ev("failed", 30, attempt="21.0"), ev("rescue_cancelled", 31, rescue_jobs=["99"])]
    assert run_has_ended(as_events(ended)) and waiting_rescues(as_events(ended)) == []
    assert not run_has_ended(as_events([*ended, ev("submitting", 40, resume=True)]))


# ---- carried out against a fake scheduler -----------------------------------------------------------


class FakeScheduler:
    kind = "slurm"

    def __init__(self, paths: RunPaths, word: str = "FAILED") -> None:
        self.paths = paths
        self.word = word
        self.calls: list[tuple[Any, ...]] = []

    def status(self, paths: RunPaths, job_id: str) -> Any:
        from hpclaunch.schedulers.protocol import JobState, SchedulerStatus

        return SchedulerStatus(JobState.FAILED, self.word)

    def continuation_held(self, plan: Any, paths: RunPaths, avoid: list[str]) -> tuple[Any, str]:
        # The continuation must not start before the attempt is recorded decided.
        assert not any(e["event"] == "requeued" for e in [e.record for e in Ledger(paths, role="t").events()])
        self.calls.append(("continue_held", tuple(avoid)))
        return plan.model_copy(update={"spare_nodes": 0}), "22"

    def submit_rescue(self, plan: Any, paths: RunPaths, job_id: str) -> str:
        self.calls.append(("rescue", job_id))
        return "23"

    def release(self, paths: RunPaths, job_id: str) -> None:
        holder = RunLock(paths).read()
        self.calls.append(("release", job_id, holder.job_id if holder else None))
        assert any(e["event"] == "requeued" for e in [e.record for e in Ledger(paths, role="t").events()])
        if self.release_fails > 0:
            self.release_fails -= 1
            from hpclaunch.errors import SchedulerError

            raise SchedulerError("scontrol release failed: Unable to contact slurm controller")

    def cancel(self, paths: RunPaths, job_id: str) -> None:
        self.calls.append(("cancel", job_id))

    release_fails = 0


def a_run(tmp_path: Path, events: list[dict[str, Any]], *, lock_job: str = "21") -> RunPaths:
    from hpclaunch.config import load_config
    from hpclaunch.orchestrator.launch import prepare, write_run_dir

    cfg = load_config(
        None,
        [
            f"run_dir={tmp_path / 'run'}",
            "scheduler.kind=slurm",
            "scheduler.nodes=2",
            "scheduler.spare_nodes=1",
        ],
    )
    prepared = prepare(cfg)
    paths = write_run_dir(cfg, prepared.plan, prepared.rendered)
    with (paths.events_dir / "agent0-n1-1.jsonl").open("w") as f:
        f.writelines(json.dumps(e) + "\n" for e in events)
    beats = paths.root / "agents" / "21.0"
    beats.mkdir(parents=True)
    for host in HOSTS:
        (beats / host).touch()
    RunLock(paths).set(LockHolder(lock_job, "slurm", "agent", "elsewhere", 4242, 1.0, 1.0))
    return paths


def test_the_rescue_takes_the_run_over_and_continues_it_without_the_batch_host(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    paths = a_run(tmp_path, running())
    fake = FakeScheduler(paths)
    monkeypatch.setattr(rescue_mod, "get_scheduler", lambda kind: fake)
    monkeypatch.setenv("SLURM_JOB_ID", "99")
    assert Rescue(paths, "21").run() == 0
    assert fake.calls == [("continue_held", ("n1",)), ("rescue", "22"), ("release", "22", "22")]
    events = [e.record for e in Ledger(paths, role="t").events()]
    (decided,) = [e for e in events if e["event"] == "requeued"]
    assert (decided["attempt"], decided["by"], decided["job_id"], decided["for_job"]) == (
        "21.0",
        "rescue",
        "22",
        "21",
    )
    assert (decided["cause"], decided["exclude"], decided["job_ended"], decided["rescue_job"]) == (
        "node_failure",
        ["n1"],
        "FAILED",
        "99",
    )
    assert "1 hot spare" not in decided["note"] and "0 hot spare(s) instead of 1" in decided["note"]
    assert [e["nodes"] for e in events if e["event"] == "node_excluded"] == [["n1"]]
    assert [e["rescue_job"] for e in events if e["event"] == "rescue_submitted"] == ["99", "23"]
    holder = RunLock(paths).read()
    assert holder is not None and (holder.job_id, holder.role) == ("22", "job")
    view = rescue_view(as_events(events))
    assert view.job_id == "23"
    assert view.notes == [
        "job 21 FAILED: its batch host died with its attempt undecided; the rescue (job 99) continued "
        "the run as job 22 without n1"
    ]


def test_the_rescues_decision_records_the_step_the_ranks_completed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The batch host died mid-step: its agent aggregated the ranks' heartbeats (rank 0 computing
    step 18), another node's rank wrote its own (step 17 saved): 17 completed, recorded with the
    rescue's decision as an agent's records it."""
    paths = a_run(tmp_path, running())
    folder = paths.attempt_dir("21.0")
    folder.mkdir(parents=True, exist_ok=True)
    beat = {"node": "n1", "step": 18, "phase": "compute", "phase_since": 1.0, "updated": 2.0}
    (folder / "node0.progress.json").write_text(json.dumps({"ranks": [{"rank": 0, **beat}]}))
    (folder / "rank1.progress.json").write_text(
        json.dumps({**beat, "rank": 1, "node": "n2", "step": 17, "phase": "save"})
    )
    monkeypatch.setattr(rescue_mod, "get_scheduler", lambda kind: FakeScheduler(paths))
    assert Rescue(paths, "21").run() == 0
    (decided,) = [e.record for e in Ledger(paths, role="t").events() if e.record["event"] == "requeued"]
    assert decided["step"] == 17


def test_the_rescue_does_nothing_and_says_so_when_the_attempt_was_decided(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    paths = a_run(tmp_path, [*running(), ev("failed", 50, attempt="21.0", cause="training")], lock_job="")
    fake = FakeScheduler(paths)
    monkeypatch.setattr(rescue_mod, "get_scheduler", lambda kind: fake)
    assert Rescue(paths, "21").run() == 0
    assert fake.calls == []
    said = [e for e in [e.record for e in Ledger(paths, role="t").events()] if e["event"] == "rescue"]
    assert [e["action"] for e in said] == ["nothing"] and "was decided" in capsys.readouterr().out


def test_the_rescue_leaves_a_run_someone_resubmitted_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    paths = a_run(tmp_path, running(), lock_job="30")
    RunLock(paths).set(LockHolder("30", "slurm", "job", "login", 0, 1.0, 9e12))  # a live, queued job
    fake = FakeScheduler(paths)
    monkeypatch.setattr(rescue_mod, "get_scheduler", lambda kind: fake)
    assert Rescue(paths, "21").run() == 0
    assert fake.calls == []
    (said,) = [e for e in [e.record for e in Ledger(paths, role="t").events()] if e["event"] == "rescue"]
    assert "held by slurm job 30" in said["reason"]


def test_slurm_tells_the_batch_hosts_death_from_a_cancellation() -> None:
    """`scontrol show job` while SLURM ends the job (measured on Slurm 22.05): the batch script
    SIGKILLed gives ExitCode 0:9 and Reason=JobLaunchFailure; scancel gives 0:0 or 0:15."""
    from hpclaunch.schedulers.slurm import batch_host_died

    assert batch_host_died({"JobState": "COMPLETING", "Reason": "JobLaunchFailure", "ExitCode": "0:9"})
    assert batch_host_died({"JobState": "FAILED", "Reason": "NonZeroExitCode", "ExitCode": "0:9"})
    assert not batch_host_died({"JobState": "COMPLETING", "Reason": "None", "ExitCode": "0:15"})
    assert not batch_host_died({"JobState": "COMPLETING", "Reason": "None", "ExitCode": "0:0"})


def test_a_continuation_asks_only_for_the_spares_the_partition_has_left(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from hpclaunch.config import load_config
    from hpclaunch.orchestrator.launch import prepare
    from hpclaunch.schedulers import slurm

    cfg = load_config(
        None, ["run_dir=/runs/x", "scheduler.kind=slurm", "scheduler.nodes=2", "scheduler.spare_nodes=1"]
    )
    plan = prepare(cfg).plan
    monkeypatch.setattr(slurm, "partition_nodes", lambda partition: ["n1", "n2", "n3"])
    assert slurm.spares_left(plan, ["n1"]) == 0  # 2 train on n2, n3
    monkeypatch.setattr(slurm, "partition_nodes", lambda partition: [f"n{i}" for i in range(1, 9)])
    assert slurm.spares_left(plan, ["n1"]) == 1
    monkeypatch.setattr(slurm, "partition_nodes", lambda partition: None)  # SLURM cannot say: keep them
    assert slurm.spares_left(plan, ["n1"]) == 1


def test_slurm_and_pbs_leave_a_continuation_the_same_spares(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """One formula (``schedulers.protocol.spares_that_fit``): SLURM counts the partition's nodes left,
    PBS Pro the hosts left; both keep every spare when the scheduler cannot say."""
    from hpclaunch.config import load_config
    from hpclaunch.orchestrator.launch import prepare
    from hpclaunch.schedulers import pbs
    from hpclaunch.schedulers.protocol import spares_that_fit

    overrides = ["scheduler.nodes=2", "scheduler.spare_nodes=2"]
    plan = prepare(load_config(None, [f"run_dir={tmp_path}", "scheduler.kind=pbs", *overrides])).plan
    assert [spares_that_fit(plan, n) for n in (None, 1, 2, 3, 4, 9)] == [2, 0, 0, 1, 2, 2]

    seen: list[int | None] = []
    monkeypatch.setattr(pbs, "usable_hosts", lambda avoid: ["h2", "h3", "h4"])
    monkeypatch.setattr(pbs, "qsub", lambda argv, cwd: "7.pbs")
    monkeypatch.setattr(
        pbs, "plan_avoiding", lambda plan, paths, avoid, spare_nodes: seen.append(spare_nodes) or plan
    )
    pbs.PbsScheduler().continuation_held(plan, RunPaths(tmp_path), ["h1"])
    assert seen == [1]


def test_the_rescue_never_imports_torch(tmp_path: Path) -> None:
    """It runs on one CPU for a few seconds: reading a ledger and one sbatch must not pay torch."""
    import subprocess
    import sys

    code = (
        "import sys, hpclaunch.jobs.rescue, hpclaunch.schedulers.slurm, hpclaunch.schedulers.pbs; "
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'numpy'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_status_says_why_a_job_that_was_continued_by_its_agents_failed() -> None:
    events = [
        *running(),
        ev("requeued", 40, attempt="21.0", cause="node_failure", job_id="22", by="agent", exclude=["n1"]),
        ev("rescue_submitted", 41, job_id="22", rescue_job="23"),
        ev("rescue", 50, attempt="21.0", job_id="21", action="nothing", reason="...", job_ended="FAILED"),
    ]
    view = rescue_view(as_events(events))
    assert view.job_id == "23"
    assert view.notes == [
        "job 21 FAILED: its batch host died after its attempt was decided (node_failure); the run "
        "continued as job 22"
    ]


def test_status_says_why_a_job_that_went_on_in_place_after_a_node_died_is_failed() -> None:
    """The head node's agent died, a spare took its place in the same job and the run finished; SLURM
    still records the job FAILED (its batch step lost a task). Status says why, beside the word."""
    from hpclaunch.orchestrator.status import Attempt, SchedulerView, _failed_for_a_node_replaced_in_place

    attempts = [
        Attempt("21.0", job_id="21", end="restarted in place", cause="node_failure", replaced={"n1": "n3"}),
        Attempt("21.1", job_id="21", end="finished", in_place=True),
    ]
    notes = _failed_for_a_node_replaced_in_place(attempts, "21", SchedulerView("failed", "FAILED", None))
    assert notes == [
        "job 21 FAILED: the scheduler counts the task that died with n1; the run went on in the same job on n3"
    ]
    assert _failed_for_a_node_replaced_in_place(attempts, "22", SchedulerView("failed", "FAILED", None)) == []


# ---- issue 36: the rescue reads the scheduler's end, the outcome and any decision; release retried --


@pytest.mark.parametrize(
    ("word", "cause"),
    [
        ("TIMEOUT", "timeout"),
        ("DEADLINE", "timeout"),
        ("PREEMPTED", "preemption"),
        ("OUT_OF_MEMORY", "crash"),
    ],
)
def test_an_end_that_is_not_the_batch_hosts_fault_spends_no_node(word: str, cause: str) -> None:
    """Before: every end but a cancel became "exclude the batch host" (rescue.py:131-146), spending
    the node-exclusion budget on a healthy node."""
    found = find(
        as_events(running()), "21", budgets=BUDGETS, seen=Seen(beats=BEATS_TOGETHER, scheduler_word=word)
    )
    d = found.decision
    assert d is not None and (d.action, d.cause, d.exclude) == (Action.CONTINUE, cause, ())
    assert found.gone == () and d.counts_as != "node"
    assert word in d.reason or "came before the attempt could save" in d.reason


def test_a_run_that_finished_before_its_job_died_is_finished() -> None:
    from hpclaunch.rundir import AttemptOutcome

    done = AttemptOutcome("finished", None, 80)
    d = find(
        as_events(running()),
        "21",
        budgets=BUDGETS,
        seen=Seen(beats=BEATS_TOGETHER, scheduler_word="FAILED", outcome=done),
    ).decision
    assert d is not None and (d.action, d.reason) == (Action.FINISH, "finished at step 80")


def test_the_batch_hosts_agent_that_left_on_a_filesystem_error_is_not_its_nodes_death() -> None:
    """Before: an ESTALE that killed node 0's agent ended the job, and the rescue excluded n1."""
    events = [
        *running(),
        ev(
            "agent_error",
            30,
            attempt="21.0",
            node=0,
            host="n1",
            error="filesystem error ESTALE",
            errno="ESTALE",
        ),
    ]
    found = find(
        as_events(events), "21", budgets=BUDGETS, seen=Seen(beats=BEATS_TOGETHER, scheduler_word="FAILED")
    )
    d = found.decision
    assert d is not None and (d.action, d.cause, d.exclude) == (Action.CONTINUE, Cause.FILESYSTEM, ())
    assert "the agent on n1 (the batch host) left: filesystem error ESTALE" in d.reason


def test_a_decision_an_agent_published_and_could_not_carry_out_is_the_one_carried_out() -> None:
    published = {
        "attempt": "21.0",
        "action": "exclude",
        "cause": "hang",
        "in_place": False,
        "by": "n2",
        "epoch": 3,
        "reason": "rank 3 hung in compute; continuing without n2",
        "exclude": ["n2"],
        "counts_as": "hang",
    }
    found = find(
        as_events(running()),
        "21",
        budgets=BUDGETS,
        seen=Seen(beats=BEATS_TOGETHER, published=published),  # type: ignore[arg-type]
    )
    d = found.decision
    assert d is not None and (d.action, d.cause, d.exclude, d.counts_as) == (
        Action.EXCLUDE,
        Cause.HANG,
        ("n2",),
        "hang",
    )
    assert found.gone == ("n2",) and "rank 3 hung" in d.reason


def _rescue(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake_word: str = "FAILED"
) -> tuple[RunPaths, FakeScheduler]:
    paths = a_run(tmp_path, running())
    fake = FakeScheduler(paths, fake_word)
    monkeypatch.setattr(rescue_mod, "get_scheduler", lambda kind: fake)
    monkeypatch.setattr(rescue_mod, "RELEASE_PAUSES_S", (0.0, 0.0, 0.0))
    monkeypatch.setenv("SLURM_JOB_ID", "99")
    return paths, fake


def test_a_release_that_fails_once_is_tried_again_fake_scheduler(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: one failed ``scontrol release`` (rescue.py:270-271) left the continuation held, owning
    the lock, the ledger saying "requeued": nothing would ever start it."""
    paths, fake = _rescue(tmp_path, monkeypatch)
    fake.release_fails = 2
    assert Rescue(paths, "21").run() == 0
    assert [c for c in fake.calls if c[0] == "release"] == [("release", "22", "22")] * 3
    holder = RunLock(paths).read()
    assert holder is not None and (holder.job_id, holder.role) == ("22", "job")
    published = json.loads((paths.attempt_dir("21.0") / "decision.json").read_text())
    assert (published["by"], published["action"]) == ("rescue", "exclude")  # one decision, the rescue's


def test_a_continuation_that_can_never_be_released_is_withdrawn_and_the_run_left_resumable_fake_scheduler(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    paths, fake = _rescue(tmp_path, monkeypatch)
    fake.release_fails = 10**6
    assert Rescue(paths, "21").run() == 1
    assert len([c for c in fake.calls if c[0] == "release"]) == 4 and ("cancel", "22") in fake.calls
    events = [e.record for e in Ledger(paths, role="t").events()]
    (failed,) = [e for e in events if e["event"] == "failed"]
    assert "could not be released" in failed["reason"] and "Unable to contact" in failed["reason"]
    assert "resumed" in failed["reason"] and RunLock(paths).read() is None  # submit --resume can take it


def test_a_time_limit_continues_through_a_held_job_on_every_node_fake_scheduler(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    paths, fake = _rescue(tmp_path, monkeypatch, fake_word="TIMEOUT")
    assert Rescue(paths, "21").run() == 0
    assert fake.calls[0] == ("continue_held", ())  # no node kept off
    events = [e.record for e in Ledger(paths, role="t").events()]
    (decided,) = [e for e in events if e["event"] == "requeued"]
    assert (decided["cause"], decided["counts_as"], decided["job_id"]) == ("timeout", "requeue", "22")
    assert not [e for e in events if e["event"] == "node_excluded"]
