"""The process writer across real processes: torchrun with 2 gloo ranks, each with its writer process.

kill -9 of every process while a writer writes: a rank (its writer dies with it, nothing is left
behind, the resume takes the previous checkpoint), a writer (every rank fails that save, the trainer
saves the step again blocking, new writers take the next save), in the data and the publish phase.
Then the trainer itself: a run whose writer is killed, and a run whose rank is killed while its
writer writes, end bitwise equal to a run without faults; a run with ``every_steps: auto`` picks its
interval from its own measurements, and ``status`` shows it.
"""

from __future__ import annotations

import itertools
import json
import math
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from tests.runlib import checkpoint_writers

from hpclaunch.rank.checkpoint import ENV_DELAY_WRITE, ENV_KILL
from hpclaunch.rundir import CHECKPOINT_FAILED, CHECKPOINT_SAVED, RunPaths, read_events
from hpclaunch.rundir.control import write_user_stop
from hpclaunch.rundir.kinds import CHECKPOINT_INTERVAL

sys.path.insert(0, str(Path(__file__).parent / "helpers"))
import trainer_helpers as h
from test_checkpoint_torchrun import launch, ok, results

pytestmark = pytest.mark.slow


writers_of = checkpoint_writers


def wait_until(done: Callable[[], bool], *, what: str, timeout: float) -> None:
    """Poll for an event (a process gone) with a generous limit: never a timing assertion."""
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout} s for {what}")
        time.sleep(0.1)


def events(run: Path, name: str) -> list[dict[str, Any]]:
    return [e.record for e in read_events(RunPaths(run)).events if e.event == name]


# Rank 1's: rank 0's own death while its writer writes is the trainer's test below
# (test_a_rank_killed_while_its_writer_writes_resumes_and_ends_bitwise, rank 0 in the data phase).
@pytest.mark.parametrize("rank", [1])
def test_kill_9_of_a_rank_while_its_writer_writes_takes_the_writer_along(tmp_path: Path, rank: int) -> None:
    ckpts = tmp_path / "checkpoints"
    crashed = launch(tmp_path, "crash", nproc=2, kill=f"20:{rank}:data")
    assert crashed.returncode != 0
    assert "Signal 9 (SIGKILL) received" in crashed.stdout + crashed.stderr
    # The writer dies with its rank (parent-death signal), the peer's with the attempt: none is left
    # to publish into the next attempt's directory. (Polled: the kernel reaps them as they go.)
    wait_until(lambda: not writers_of(ckpts), what="the writer processes to be gone", timeout=60)
    assert not (ckpts / "step_000020").exists() and (ckpts / "step_000010").exists()
    (leftover,) = ckpts.glob(".step_000020.tmp-*")
    ok(launch(tmp_path, "resume", nproc=2))
    got = results(tmp_path, "resume", 2)
    assert all(r["loaded_step"] == 10 and r["model_ok"] for r in got)
    assert not leftover.exists()


# Each rank and each phase once (each pair is two torchrun launches of two ranks: ~20 core-s): rank 0
# in the data phase, rank 1 in the publish phase; rank 1 in the data phase is the trainer's test
# below (test_a_run_whose_writer_is_killed_saves_again_blocking_and_ends_bitwise).
@pytest.mark.parametrize(("rank", "phase"), [(0, "data"), (1, "publish")])
def test_kill_9_of_a_writer_fails_that_save_on_every_rank_and_the_blocking_retry_keeps_the_step(
    tmp_path: Path, rank: int, phase: str
) -> None:
    ckpts = tmp_path / "checkpoints"
    ok(launch(tmp_path, "writerkill", nproc=2, kill=f"20:{rank}:{phase}:writer"))
    got = results(tmp_path, "writerkill", 2)
    assert all(r["writer_forked"] for r in got)  # the killed writers were the forked ones
    killed = got[rank]
    assert killed["error"] is not None
    assert (
        f"writer process of rank {rank} (pid {killed['first_writer']}) died (killed by SIGKILL)"
        in killed["error"]
    )
    assert got[1 - rank]["error"] is not None  # the peer's save failed too, at the same point
    for r in got:  # every rank replaced its writer: the next save ran in a new generation
        assert r["second_writer"] not in (None, r["first_writer"])
    assert not writers_of(ckpts)  # close() ended the new ones; the killed ones are gone
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_000010", "step_000020", "step_000030"]
    ok(launch(tmp_path, "resume", nproc=2))
    resumed = results(tmp_path, "resume", 2)
    assert [r["loaded_step"] for r in resumed] == [30, 30]
    assert [r["rank_local_value"] for r in resumed] == [3000.0, 3001.0]


def test_a_rank_that_closes_alone_is_not_held_by_the_others(tmp_path: Path) -> None:
    # A rank leaving on an error closes its checkpointer with a background save pending while the
    # other ranks are elsewhere: the close waits for its own writer, never in a collective.
    ok(launch(tmp_path, "closealone", nproc=2))
    assert [r["closed"] for r in results(tmp_path, "closealone", 2)] == [True, True]
    assert (tmp_path / "checkpoints" / "step_000010").is_dir()  # the writers finished it together
    assert not writers_of(tmp_path / "checkpoints")


def test_async_save_with_more_than_1024_descriptors_open_in_every_rank_loads_bitwise(tmp_path: Path) -> None:
    # At a few hundred ranks the gloo groups' sockets push the writer's channel past descriptor
    # 1023, where select() raised ValueError on the first background save. Every rank opens 1,100
    # descriptors first, so every socket after them (gloo's, the channel) is numbered above 1,100.
    ok(launch(tmp_path, "roundtrip", nproc=2, extra_env={"CKPT_OPEN_FDS": "1100"}))
    for rank, res in enumerate(results(tmp_path, "roundtrip", 2)):
        assert res["open_fds"] > 1100, rank
        assert res["loaded_step"] == 4 and res["staged_mismatch"] == [], rank
        assert res["final_mismatch"] == [], f"rank {rank}: resumed run diverged"
    (saved,) = events(tmp_path, CHECKPOINT_SAVED)
    assert saved["blocking"] is False


# ---- the trainer ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("writer")


@pytest.fixture(scope="module")
def data(root: Path) -> Path:
    return h.make_data(root)


@pytest.fixture(scope="module")
def reference(root: Path, data: Path) -> str:
    """params_sha256 of 60 uninterrupted steps with no periodic save."""
    run = h.make_run(root, "reference", data)
    proc = h.train(run)
    assert proc.returncode == 0, h.describe(proc)
    return str(h.outcome(run)["params_sha256"])


def train_with(run: Path, attempt: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        h.command(run), env=h.env_for(attempt, env), capture_output=True, text=True, timeout=300
    )


def test_a_run_whose_writer_is_killed_saves_again_blocking_and_ends_bitwise(
    reference: str, root: Path, data: Path
) -> None:
    run = h.make_run(root, "writer-killed", data, ["checkpoint.every_steps=10"])
    proc = train_with(run, "a1", {ENV_KILL: "20:1:data:writer"})
    assert proc.returncode == 0, h.describe(proc)
    out = h.outcome(run)
    assert out["status"] == "finished" and out["params_sha256"] == reference
    (failed,) = events(run, CHECKPOINT_FAILED)
    # Rank 0 writes the ledger: its own writer failed only because rank 1's died, and says so.
    assert "checkpoint writer process of another rank died while saving step 20" in failed["error"]
    assert failed["action"] == "blocking retry" and failed["step"] >= 20
    saved = [(e["step"], e["blocking"]) for e in events(run, CHECKPOINT_SAVED)]
    assert (failed["step"], True) in saved and saved[-1] == (60, True)
    assert not writers_of(RunPaths(run).checkpoints)


def test_a_rank_killed_while_its_writer_writes_resumes_and_ends_bitwise(
    reference: str, root: Path, data: Path
) -> None:
    run = h.make_run(root, "rank-killed", data, ["checkpoint.every_steps=10"])
    crashed = train_with(run, "a1", {ENV_KILL: "30:0:data"})
    assert crashed.returncode != 0
    wait_until(lambda: not writers_of(RunPaths(run).checkpoints), what="writers gone", timeout=60)
    proc = h.train(run, attempt="a2")
    assert proc.returncode == 0, h.describe(proc)
    resumed = [e for e in h.events(run) if e["event"] == "resumed" and e["attempt"] == "a2"]
    assert resumed[0]["step"] == 20  # the save of step 30 was never published
    assert h.outcome(run, "a2")["params_sha256"] == reference


def check_decisions(decisions: list[dict[str, Any]], saved: list[int], mtbf_s: float) -> None:
    """The first decision saves at once (nothing measured); every later one is Young/Daly of what
    the run measured, and the next save happens where it said."""
    first, measured = decisions[0], decisions[1:]
    assert first["mode"] == "auto" and first["step"] == 5 and first["interval_steps"] == 0
    assert first["save_cost_s"] is None and first["next_step"] == 5 and saved[0] == 5
    assert measured, decisions
    for d in measured:
        assert d["save_cost_s"] > 0 and d["step_time_s"] > 0 and d["mtbf_s"] == pytest.approx(mtbf_s)
        expected = math.sqrt(2 * d["save_cost_s"] * d["mtbf_s"])
        if d["bounded_by"] == "run end":  # Young/Daly's next save would come at or after the last step
            assert d["next_step"] == 61 and d["step"] + round(expected / d["step_time_s"]) >= 59, d
            continue
        # The ledger rounds the interval to 1 ms and the cost to 0.1 ms: recomputed from the rounded
        # cost, a 0.495 s interval read 0.4945 s (a cost of 0.0849 s): within 1 ms, not 0.1 %.
        assert d["interval_s"] == pytest.approx(expected, rel=1e-3, abs=1e-3)
        assert abs(d["interval_steps"] - max(1, round(expected / d["step_time_s"]))) <= 1
        assert d["expected_loss_per_failure_s"] == pytest.approx(expected / 2, rel=1e-2)  # T*/2
    for d, after in itertools.pairwise(measured):
        assert d["next_step"] in saved and after["step"] >= d["next_step"]
    # No save but where a decision put it (a periodic save never follows the last before it settled).
    assert set(saved) <= {5} | {d["next_step"] for d in measured}, (saved, decisions)


def check_status(run: Path, last: dict[str, Any]) -> None:
    status = h.hpclaunch_cli(["status", str(run), "--json"])
    assert status.returncode == 0, status.stderr
    shown = json.loads(status.stdout)["checkpoint_interval"]
    assert shown["interval_steps"] == last["interval_steps"] and shown["mode"] == "auto"
    assert shown["expected_loss_per_failure_s"] == last["expected_loss_per_failure_s"]
    text = h.hpclaunch_cli(["status", str(run)]).stdout
    said = (
        "checkpoints: no periodic save before the run's last step"
        if last["bounded_by"]
        else f"checkpoints: every {last['interval_steps']} steps"
    )
    assert said in text and "a failure is expected to lose" in text


def test_every_steps_auto_picks_its_interval_from_its_own_measurements(
    reference: str, root: Path, data: Path
) -> None:
    # Blocking saves (their cost is known as they end, so the run decides at fixed points whatever
    # the machine's load) and an MTBF of 1.44 s: an interval of a few steps in a 60-step run.
    sets = ["checkpoint.every_steps=auto", "checkpoint.mtbf_hours=0.0004", "checkpoint.async_save=false"]
    run = h.make_run(root, "auto", data, sets)
    proc = h.train(run)
    assert proc.returncode == 0, h.describe(proc)
    assert h.outcome(run)["params_sha256"] == reference  # when it saves never changes the math
    decisions = events(run, CHECKPOINT_INTERVAL)
    saved = [e["step"] for e in events(run, CHECKPOINT_SAVED) if e["step"] < 60]  # 60: the final save
    check_decisions(decisions, saved, 1.44)
    assert len(decisions) >= 2  # at least the decision after the measuring save; more as time allows
    check_status(run, decisions[-1])


def test_every_steps_auto_measures_a_background_save_of_the_process_writer(root: Path, data: Path) -> None:
    # A background save's cost is known when it settles, which depends on the writer's start-up and
    # the machine's load: the run goes on (slowly) until the ledger shows a measured decision, then
    # it is stopped through the control file.
    sets = ["checkpoint.every_steps=auto", "checkpoint.mtbf_hours=0.0004", "train.steps=100000"]
    run = h.make_run(root, "auto-process", data, [*sets, "testing.step_sleep_s=0.02"])
    proc = h.start(run)
    try:
        wait_until(
            lambda: len(events(run, CHECKPOINT_INTERVAL)) >= 3 or proc.poll() is not None,
            what="two measured decisions",
            timeout=600,
        )
    finally:
        write_user_stop(RunPaths(run), continue_=False, attempt=None, by="test")
        _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    decisions = events(run, CHECKPOINT_INTERVAL)
    saved = [e["step"] for e in events(run, CHECKPOINT_SAVED) if not e["blocking"]]
    check_decisions(decisions, saved, 1.44)
    assert all(e["writer"] == "process" for e in events(run, CHECKPOINT_SAVED) if not e["blocking"])
    check_status(run, decisions[-1])


def test_a_settled_background_save_is_the_measured_save_the_stop_lead_keeps_room_for(
    root: Path, data: Path
) -> None:
    """Issue 25 (6): an attempt whose only save so far ran in the background stopped for its
    deadline with the plan's estimate of a save, and on a loaded machine saved past the walltime.
    The settled background save is a measured save from the step it settles; `stopped` says the
    lead and the save it kept room for."""
    run = h.make_run(
        root,
        "lead",
        data,
        ["checkpoint.every_steps=20", "train.steps=100000", "testing.step_sleep_s=0.2"],
    )
    proc = h.start(run)
    try:
        wait_until(
            lambda: any(not e["blocking"] for e in events(run, CHECKPOINT_SAVED)) or proc.poll() is not None,
            what="the first background save",
            timeout=600,
        )
    finally:
        write_user_stop(RunPaths(run), continue_=False, attempt=None, by="test")
        _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    (stopped,) = events(run, "stopped")
    saved = events(run, CHECKPOINT_SAVED)
    first_blocking = min(e["step"] for e in saved if e["blocking"])
    assert first_blocking == stopped["step"]  # no blocking save before the stop's own
    assert stopped["save_s"] is not None and stopped["save_s"] > 0, stopped
    assert stopped["lead_s"] is None  # no scheduler clock here: no deadline


def test_a_stop_drops_a_background_save_still_writing_and_saves_its_newer_step_at_once(
    root: Path, data: Path
) -> None:
    """Issue 25 (6): the stop's save waited for the background save of step 50, whose writer (idle
    priority, two busy cores) was starved and started again: 15 s past the deadline, after PBS's
    walltime. A stop saves a newer step: the save still writing is dropped (every writer stopped,
    its directory removed) and the stop's own save is written at once."""
    run = h.make_run(
        root,
        "superseded",
        data,
        [
            "checkpoint.every_steps=100",  # the next is 100 steps away: it would wait for the first
            "train.steps=100000",
            "train.log_every=1",
            "testing.step_sleep_s=0.05",
        ],
    )
    # Only the writer processes sleep (background saves): the stop's blocking save does not.
    proc = h.start(run, env={ENV_DELAY_WRITE: "600:writer"})
    try:
        wait_until(
            lambda: bool(writers_of(run / "checkpoints")) or proc.poll() is not None,
            what="the first background save's writers",
            timeout=600,
        )
        h.wait_for_step(run, 102, proc, timeout=600)  # the save of step 100 was handed to them
    finally:
        write_user_stop(RunPaths(run), continue_=False, attempt=None, by="test")
        _, err = proc.communicate(timeout=300)  # far less than the writers' 600 s sleep
    assert proc.returncode == 0, err[-3000:]
    (superseded,) = events(run, "checkpoint_superseded")
    (stopped,) = events(run, "stopped")
    assert superseded["step"] == 100 and 100 < stopped["step"] < 200
    (saved,) = events(run, CHECKPOINT_SAVED)
    assert saved["blocking"] and saved["step"] == stopped["step"]
    kept = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert kept == [Path(saved["path"]).name], kept  # nothing half-written left behind
    wait_until(lambda: not writers_of(run / "checkpoints"), what="the writers gone", timeout=60)
