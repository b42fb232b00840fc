"""Chains (``rundir.chain``, ``schedulers.chain_release``): the verdict from the earlier run's ledger, the
exactly-once claim, and the local scheduler's held controller released or cancelled for real."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from hpclaunch.rundir import (
    CANCELLED,
    ENDED,
    FAILED,
    FINISHED,
    REQUEUED,
    SUBMIT_FAILED,
    SUBMITTED,
    SUBMITTING,
    Ledger,
    RunPaths,
    read_events,
)
from hpclaunch.rundir.chain import Follower, claim, followers, register, verdict
from hpclaunch.rundir.events import as_events
from hpclaunch.schedulers.chain_release import settle_followers
from hpclaunch.schedulers.local import LocalScheduler, read_state

pytestmark = pytest.mark.fast

RUN = Path("/runs/stage1")


def ev(*kinds: str, **fields: object) -> list[dict[str, object]]:
    return [{"event": k, **fields} for k in kinds]


@pytest.mark.parametrize(
    ("events", "action", "state"),
    [
        (ev(SUBMITTED), "wait", "running"),
        (ev(SUBMITTED, REQUEUED, REQUEUED), "wait", "running"),  # requeues and continuations: not over
        (ev(SUBMITTED, REQUEUED, FINISHED), "release", "finished"),
        (ev(SUBMITTED, FAILED), "cancel", "failed"),
        (ev(SUBMITTED, CANCELLED), "cancel", "cancelled"),
        (ev(SUBMITTED, ENDED), "wait", "stopped"),  # a user stop may be resumed
        (ev(SUBMITTED, ENDED, SUBMITTED, FINISHED), "release", "finished"),  # ... and was
        (ev(SUBMITTED, FAILED, SUBMITTED), "wait", "running"),  # resumed after a failure
        (ev(SUBMITTED, FINISHED, "held"), "release", "finished"),  # a stray requeue after the end
        # Issue 26: the job ended before `submit` heard the scheduler's answer (submitting ->
        # finished -> submitted): that end is this submission's.
        (ev(SUBMITTING, FINISHED, SUBMITTED), "release", "finished"),
        (ev(SUBMITTED, ENDED, SUBMITTING, FAILED, SUBMITTED), "cancel", "failed"),
        (ev(SUBMITTED, FAILED, SUBMITTING), "wait", "running"),  # a resume in flight
        (ev(SUBMITTED, FAILED, SUBMITTING, SUBMIT_FAILED), "cancel", "failed"),  # it was refused
    ],
)
def test_verdict_from_the_earlier_runs_ledger(
    events: list[dict[str, object]], action: str, state: str
) -> None:
    v = verdict(as_events(events), RUN)  # type: ignore[arg-type]
    assert (v.action, v.state) == (action, state)


def test_a_failure_says_why() -> None:
    v = verdict(
        as_events([*ev(SUBMITTED), {"event": FAILED, "cause": "training", "error": "3 non-finite steps"}]),
        RUN,
    )
    assert v.reason == "/runs/stage1 failed (training: 3 non-finite steps)"


def test_the_claim_is_won_exactly_once(tmp_path: Path) -> None:
    follower = Follower(tmp_path / "stage2", "slurm", "42")
    v = verdict(as_events(ev(SUBMITTED, FINISHED)), RUN)
    won: list[bool] = []
    start = threading.Barrier(8)

    def race() -> None:
        start.wait()
        won.append(claim(follower, v, by="test"))

    threads = [threading.Thread(target=race) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(won) == [False] * 7 + [True]
    settled = json.loads((tmp_path / "stage2" / "chain" / "settled-42.json").read_text())
    assert settled["action"] == "release" and settled["by"] == "test"


def held_local_run(root: Path) -> tuple[RunPaths, str]:
    """A real local controller, held, whose job script only records that it ran."""
    from hpclaunch.config import load_config
    from hpclaunch.orchestrator.launch import prepare, write_run_dir

    cfg = load_config(None, [f"run_dir={root}", "name=stage2"])
    prepared = prepare(cfg)
    paths = write_run_dir(cfg, prepared.plan, prepared.rendered)
    script = f"#!/bin/bash\necho ran > {root / 'ran'}\n"
    (root / prepared.rendered.filename).write_text(script)
    job = LocalScheduler().submit_held(
        prepared.plan, prepared.rendered.__class__(script, prepared.rendered.filename)
    )
    return paths, job


def wait(predicate: object, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return
        time.sleep(0.1)
    raise TimeoutError


@pytest.mark.spawns
def test_a_finished_run_releases_its_held_local_follower_once(tmp_path: Path) -> None:
    stage1 = RunPaths(tmp_path / "stage1").ensure()
    paths, job = held_local_run(tmp_path / "stage2")
    assert read_state(paths.scheduler_dir)["state"] == "held"
    register(stage1, Follower(paths.root, "local", job), paths)
    ledger = Ledger(stage1, role="agent")
    ledger.append(SUBMITTED, job_id="1")
    assert settle_followers(stage1, by="test") == []  # still running: nothing happens
    time.sleep(1.0)
    assert not (paths.root / "ran").exists()
    ledger.append(FINISHED)
    done = settle_followers(stage1, by="agent")
    assert [(f.job_id, v.action) for f, v in done] == [(job, "release")]
    assert settle_followers(stage1, by="hpclaunch submit") == []  # settled already
    wait(lambda: (paths.root / "ran").exists())
    wait(lambda: read_state(paths.scheduler_dir).get("state") == "completed")
    kinds = [e["event"] for e in [e.record for e in read_events(paths).events]]
    assert kinds.count("chain_released") == 1 and CANCELLED not in kinds
    assert [
        e["event"] for e in [e.record for e in read_events(stage1).events] if e["event"].startswith("chain")
    ] == ["chain_released"]
    assert [f.run for f in followers(stage1)] == [paths.root]


@pytest.mark.spawns
def test_a_failed_run_cancels_its_held_local_follower_and_says_why(tmp_path: Path) -> None:
    stage1 = RunPaths(tmp_path / "stage1").ensure()
    paths, job = held_local_run(tmp_path / "stage2")
    register(stage1, Follower(paths.root, "local", job), paths)
    Ledger(stage1, role="agent").append(FAILED, cause="crash", error="boom")
    settle_followers(stage1, by="agent")
    wait(lambda: read_state(paths.scheduler_dir).get("state") == "cancelled")
    assert not (paths.root / "ran").exists()
    events = [e.record for e in read_events(paths).events]
    cancelled = [e for e in events if e["event"] == CANCELLED]
    assert (
        len(cancelled) == 1
        and cancelled[0]["by"] == "chain"
        and "failed (crash: boom)" in cancelled[0]["reason"]
    )
    from hpclaunch.orchestrator.status import summarize

    view = summarize(paths.root).to_json()
    assert view["state"] == "cancelled"
    assert view["chain"]["after"]["outcome"] == "cancelled" and "boom" in view["chain"]["after"]["reason"]


class FlakyScheduler:
    """A scheduler whose release times out ``failures`` times (an `scontrol release` timeout)."""

    def __init__(self, failures: int) -> None:
        self.failures, self.released = failures, 0

    def release(self, paths: RunPaths, job_id: str) -> None:
        from hpclaunch.errors import SchedulerError

        if self.failures:
            self.failures -= 1
            raise SchedulerError("scontrol release timed out after 30 s")
        self.released += 1

    def cancel(self, paths: RunPaths, job_id: str) -> None:
        raise AssertionError("not cancelled")


def test_a_release_that_fails_for_a_moment_is_retried_within_the_pass_quietly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 26: a failed release was never tried again. Issue 36: the pass itself tries again (a
    scheduler's brief outage), and says nothing of the tries that failed before one worked."""
    import hpclaunch.schedulers.chain_release as schain

    fake = FlakyScheduler(failures=3)
    monkeypatch.setattr(schain, "get_scheduler", lambda kind: fake)
    monkeypatch.setattr(schain, "RETRY_NOW_S", (0.0,) * 4)
    stage1, stage2 = RunPaths(tmp_path / "stage1").ensure(), RunPaths(tmp_path / "stage2").ensure()
    register(stage1, Follower(stage2.root, "slurm", "77"), stage2)
    Ledger(stage1, role="agent").append(SUBMITTED, job_id="1")
    Ledger(stage1, role="agent").append(FINISHED)
    settle_followers(stage1, by="agent")
    assert fake.released == 1
    for run in (stage1, stage2):
        kinds = [e.event for e in read_events(run).events if e.event.startswith("chain")]
        assert kinds == ["chain_released"]


def test_chain_retries_are_bounded_and_status_never_calls_the_scheduler(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 36 (schedulers/chain_release.py): every ``status`` of either run retried a failed release
    (status changed the scheduler) and appended to both ledgers at most every 600 s, for ever."""
    import hpclaunch.rundir.chain as rchain
    import hpclaunch.schedulers.chain_release as schain
    from hpclaunch.cli.views import status_view
    from hpclaunch.orchestrator.lineage import chain_view, describe_chain

    fake = FlakyScheduler(failures=10**6)
    monkeypatch.setattr(schain, "get_scheduler", lambda kind: fake)
    monkeypatch.setattr(schain, "RETRY_NOW_S", (0.0,) * 4)
    stage1, stage2 = RunPaths(tmp_path / "stage1").ensure(), RunPaths(tmp_path / "stage2").ensure()
    register(stage1, Follower(stage2.root, "slurm", "77"), stage2)
    Ledger(stage1, role="agent").append(SUBMITTED, job_id="1")
    Ledger(stage1, role="agent").append(FINISHED)
    settle_followers(stage1, by="agent")  # 5 tries within the pass
    assert fake.failures == 10**6 - 5
    view = chain_view(stage2)
    assert view is not None and view.after is not None and view.after.outcome == "retrying"
    calls = fake.failures
    for run in (stage1, stage2):
        status_view(run)
    assert fake.failures == calls  # looking changes nothing
    monkeypatch.setattr(rchain, "RETRY_BACKOFF_S", 0.0)
    for _ in range(5):  # later passes: a cancel, a submit --after
        settle_followers(stage1, by="hpclaunch cancel")
    assert fake.failures == 10**6 - 5 * rchain.MAX_PASSES and fake.released == 0
    blocked = [e.record for e in read_events(stage2).events if e.event == "chain_blocked"]
    assert [(e["tries"], e["retry"]) for e in blocked] == [(1, True), (2, True), (3, False)]
    assert blocked[-1]["hint"] == "scontrol release 77"
    assert len([e for e in read_events(stage1).events if e.event == "chain_blocked"]) == rchain.MAX_PASSES
    view = chain_view(stage2)
    assert view is not None and view.after is not None and view.after.outcome == "blocked"
    assert "release job 77 by hand (scontrol release 77" in describe_chain(view)[0]
