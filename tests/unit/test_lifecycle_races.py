"""Issue 16: what happens when two things happen at once or a fault is transient (one test or more
per finding; the end-to-end ones on the local scheduler are in tests/integration/
test_lifecycle_races.py, the real-SLURM one in tests/cluster/test_slurm_runs.py)."""

from __future__ import annotations

import errno
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from hpclaunch.config import load_config
from hpclaunch.errors import DataError, FilesystemError, RunLockedError
from hpclaunch.jobs.decision_rules import Action, Budgets, Facts, History, decide, decide_start
from hpclaunch.jobs.node_run import NodeRun
from hpclaunch.jobs.stop_relay import StopRelay
from hpclaunch.jobs.watchdog import SLOW_IO_BPS, CheckpointScale, window_s
from hpclaunch.orchestrator import launch
from hpclaunch.orchestrator.status import attempts_from_events
from hpclaunch.rank.checkpoint import RANK_LOCAL, Checkpointer, RunCheckpoints, rank_local_key
from hpclaunch.rank.stop import StopController
from hpclaunch.rundir import Ledger, RunLock, RunPaths, read_events
from hpclaunch.rundir import checkpoint_manifest as manifest_mod
from hpclaunch.rundir.cause import Cause
from hpclaunch.rundir.checkpoint_manifest import CheckpointInfo, verify_share
from hpclaunch.rundir.control import take_user_stop, user_stop, write_user_stop
from hpclaunch.rundir.events import as_events
from hpclaunch.rundir.lock import STALE_AFTER_S, LockHolder, liveness
from hpclaunch.rundir.plan import rdzv_port_for
from hpclaunch.schedulers import slurm
from hpclaunch.schedulers.protocol import JobState, NodeContext, SchedulerStatus

BUDGETS = Budgets(max_requeues=3, max_failure_retries=1, max_node_excludes=2, max_hang_retries=3)


# ---- 1. a user's stop is never lost to a scheduler warning ------------------------------------------


class _Scheduler:
    """What the relay asks a scheduler: only what a SIGTERM was and the kill grace."""

    def __init__(self, cause: Cause = Cause.PREEMPTION) -> None:
        self.cause = cause

    def termination_cause(self, paths: RunPaths, ctx: NodeContext, *, now: float) -> Cause:
        return self.cause

    def kill_grace_s(self, plan: Any) -> float:
        return 30.0


def _relay(tmp_path: Path, attempt: str, node: int = 0, cause: Cause = Cause.PREEMPTION) -> StopRelay:
    job, restart = attempt.split(".")
    ctx = NodeContext("slurm", job, node, 2, f"n{node}", ("n0", "n1"), restart_count=int(restart))
    paths = RunPaths(tmp_path)
    plan: Any = None
    return StopRelay(NodeRun.start(paths, plan, ctx, _Scheduler(cause)))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "order",
    [
        "stop, warning, ranks check",
        "warning, stop, ranks check",
        # the ranks check every ~2 s: between the warning and the stop is the common case
        "warning, ranks check, stop",
    ],
)
def test_a_user_stop_and_a_warning_in_one_attempt_end_the_run(tmp_path: Path, order: str) -> None:
    """Before: the relay overwrote the control file with the stronger cause and the decision read
    "timeout": requeued. Now the requests are apart and the decision ends the run."""
    from hpclaunch.rundir import AttemptOutcome

    paths = RunPaths(tmp_path)
    relay = _relay(tmp_path, "7.0")
    seen: list[Cause] = []
    steps = {
        "warning": lambda: (
            relay.inbox.received.append((signal.SIGUSR2, time.time())),
            relay.handle_signals(),
        ),
        "stop": lambda: write_user_stop(paths, continue_=False, attempt="7.0", by="hpclaunch stop"),
        "ranks check": lambda: seen.append(StopController(paths=paths, attempt="7.0").check(1, 0.1)),
    }
    for name in order.split(", "):
        steps[name]()
    assert seen == [Cause.TIMEOUT]  # they save for the stronger cause...
    taken = take_user_stop(paths, "7.0")
    assert taken is not None
    facts = Facts(AttemptOutcome("stopped", seen[0], 40), user_stop=True, continue_requested=taken.continue_)
    d = decide(facts, History(), BUDGETS, can_exclude_nodes=True)
    assert (d.action, d.cause) == (Action.END, Cause.USER)  # ... and the run ends as the user said


def test_a_continue_never_outlives_its_request(tmp_path: Path) -> None:
    """Before: `stop --continue` left a `continue` file that turned a later plain stop into a continue."""
    paths = RunPaths(tmp_path)
    write_user_stop(paths, continue_=True, attempt="7.0", by="hpclaunch stop")
    assert take_user_stop(paths, "7.0").continue_  # type: ignore[union-attr]
    write_user_stop(paths, continue_=False, attempt="7.1", by="hpclaunch stop")
    later = take_user_stop(paths, "7.1")
    assert later is not None and not later.continue_


def test_a_continue_in_an_attempt_that_ended_for_a_warning_does_not_outlive_it(tmp_path: Path) -> None:
    """Before: the agent deleted the `continue` file only when the decision honoured it (cause user);
    an attempt that ended for the scheduler's warning left it, and a plain stop in the next attempt
    then continued the run."""
    from hpclaunch.rundir import AttemptOutcome

    paths = RunPaths(tmp_path)
    write_user_stop(paths, continue_=True, attempt="7.0", by="hpclaunch stop")
    relay = _relay(tmp_path, "7.0")
    relay.inbox.received.append((signal.SIGUSR2, time.time()))
    relay.handle_signals()
    ranks_see = StopController(paths=paths, attempt="7.0").check(1, 0.1)
    taken = take_user_stop(paths, "7.0")
    facts = Facts(
        AttemptOutcome("stopped", ranks_see, 10),
        user_stop=taken is not None,
        continue_requested=bool(taken and taken.continue_),
    )
    assert decide(facts, History(), BUDGETS, can_exclude_nodes=True).action is Action.CONTINUE
    write_user_stop(paths, continue_=False, attempt="7.1", by="hpclaunch stop")
    later = take_user_stop(paths, "7.1")
    assert later is not None and not later.continue_
    facts = Facts(
        AttemptOutcome("stopped", Cause.USER, 20), user_stop=True, continue_requested=later.continue_
    )
    d = decide(facts, History(), BUDGETS, can_exclude_nodes=True)
    assert (d.action, d.cause) == (Action.END, Cause.USER)


# ---- 2. stale stop requests ----------------------------------------------------------------------


def test_a_late_nodes_relay_does_not_stop_the_next_attempt(tmp_path: Path) -> None:
    """Node 1's agent gets the requeue's SIGTERM after node 0 decided: it relays for its attempt,
    which is over; the next attempt trains on (it used to stop after one step, every time)."""
    paths = RunPaths(tmp_path)
    node0 = _relay(tmp_path, "7.0", node=0)
    node0.inbox.received.append((signal.SIGTERM, time.time()))
    node0.handle_signals()
    take_user_stop(paths, "7.0")  # node 0 decides: requests of the attempt are cleared
    late = _relay(tmp_path, "7.0", node=1)
    late.inbox.received.append((signal.SIGTERM, time.time()))
    late.handle_signals()
    assert StopController(paths=paths, attempt="7.1").check(1, 0.1) is None


# ---- 3. a transient read error never condemns a checkpoint or the data ---------------------------


def _ckpt(tmp_path: Path) -> Checkpointer:
    checkpoints = RunCheckpoints(tmp_path / "ckpt", 1, config_hash="cfg", model_hash="m", keep_last=5)
    return Checkpointer(checkpoints, rank=0, ledger=Ledger(RunPaths(tmp_path), role="trainer"))


def _state(step: int) -> dict[str, Any]:
    return {
        "model": {"w": torch.full((8, 8), float(step))},
        RANK_LOCAL: {rank_local_key(0): {"torch_rng": torch.get_rng_state()}},
    }


def _failing_reads(monkeypatch: pytest.MonkeyPatch, name: str, times: int, err: int = errno.EIO) -> list[int]:
    """Make reading files called ``name`` fail ``times`` times with ``err`` (then work)."""
    calls = [0]
    real_read_text, real_open = Path.read_text, open

    def read_text(self: Path, *a: Any, **k: Any) -> str:
        if self.name == name and calls[0] < times:
            calls[0] += 1
            raise OSError(err, os.strerror(err), str(self))
        return real_read_text(self, *a, **k)

    def opener(file: Any, *a: Any, **k: Any) -> Any:
        if Path(str(file)).name == name and calls[0] < times:
            calls[0] += 1
            raise OSError(err, os.strerror(err), str(file))
        return real_open(file, *a, **k)

    monkeypatch.setattr(Path, "read_text", read_text)
    monkeypatch.setattr(manifest_mod, "open", opener, raising=False)
    monkeypatch.setattr("hpclaunch.fsutil.time.sleep", lambda s: None)
    return calls


@pytest.mark.parametrize("err", [errno.EIO, errno.ESTALE, errno.EACCES])
def test_a_manifest_that_cannot_be_read_now_is_not_corrupt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, err: int
) -> None:
    ck = _ckpt(tmp_path)
    for step in (10, 20):
        ck.save(step, _state(step), blocking=True)
    ck.close()
    calls = _failing_reads(monkeypatch, "manifest.json", times=10**6, err=err)
    with pytest.raises(FilesystemError, match=r"cannot read manifest\.json now"):
        _ckpt(tmp_path).load_latest(_state(0))
    assert calls[0] > 1  # read again before giving up
    names = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert names == ["step_000010", "step_000020"]  # nothing moved aside as corrupt


def test_a_manifest_read_that_fails_once_loads_the_newest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ck = _ckpt(tmp_path)
    for step in (10, 20):
        ck.save(step, _state(step), blocking=True)
    ck.close()
    _failing_reads(monkeypatch, "manifest.json", times=1)
    into = _state(0)
    result = _ckpt(tmp_path).load_latest(into)
    assert result is not None and result.info.step == 20 and float(into["model"]["w"][0, 0]) == 20.0


def test_a_data_file_hash_that_fails_now_is_retried_as_a_filesystem_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: a transient error while reading a shard became DataError: the run's own failure,
    never retried. Now: FilesystemError (cause filesystem), retried within the crash budget."""
    from hpclaunch.shards import format as shard_format
    from hpclaunch.shards.synth import synth_dataset
    from hpclaunch.trainer.entry import failure_cause

    cfg = load_config(None, [])
    synth_dataset(tmp_path / "d", samples=16, model_cfg=cfg.model, seed=0)
    shard = next((tmp_path / "d" / "latents").glob("*.npy"))
    real_load = np.load

    def broken(path: Any, *a: Any, **k: Any) -> Any:
        if Path(str(path)) == shard:
            raise OSError(errno.ESTALE, "Stale file handle", str(path))
        return real_load(path, *a, **k)

    monkeypatch.setattr(shard_format.np, "load", broken)
    monkeypatch.setattr("hpclaunch.fsutil.time.sleep", lambda s: None)
    with pytest.raises(FilesystemError) as caught:
        shard_format.open_latent_array(shard)
    assert failure_cause(caught.value) is Cause.FILESYSTEM
    d = decide(
        Facts(_failed(Cause.FILESYSTEM, caught.value.one_line())), History(), BUDGETS, can_exclude_nodes=True
    )
    assert d.action is Action.CONTINUE and d.counts_as == "crash"
    monkeypatch.setattr(
        shard_format.np, "load", lambda *a, **k: (_ for _ in ()).throw(ValueError("bad header"))
    )
    with pytest.raises(DataError):  # a file that *is* bad stays the data's fault
        shard_format.open_latent_array(shard)


def _failed(cause: Cause, error: str) -> Any:
    from hpclaunch.rundir import AttemptOutcome

    return AttemptOutcome("failed", cause, 3, error)


def test_every_rank_hashes_only_its_share(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    files = {f"__{i}_0.distcp": {"bytes": 3, "sha256": "x"} for i in range(5)}
    files[".metadata"] = {"bytes": 3, "sha256": "x"}
    for name in files:
        (tmp_path / name).write_bytes(b"abc")
    hashed: list[str] = []
    monkeypatch.setattr(manifest_mod, "file_digest", lambda p: (hashed.append(p.name), (3, "x"))[1])
    info = CheckpointInfo(step=1, path=tmp_path, manifest={"files": files})
    shares = []
    for rank in range(3):
        hashed.clear()
        verify_share(info, rank, 3)
        shares.append(sorted(hashed))
    assert sorted(n for share in shares for n in share) == sorted(files)  # every file once
    assert max(len(s) for s in shares) == 2  # a third each, not all on rank 0


# ---- 4. the run lock -------------------------------------------------------------------------------


def _holder(job: str, *, host: str = "elsewhere", age: float = 0.0, role: str = "agent") -> LockHolder:
    now = time.time()
    return LockHolder(job, "slurm", role, host, 4242, now - age, now - age)


def test_a_scheduler_that_cannot_be_asked_means_alive_and_says_so() -> None:
    stale = _holder("77", age=2 * STALE_AFTER_S)
    live = liveness(stale, is_active=lambda h: None)
    assert live.alive and "cannot be asked whether job 77 is alive; assuming it is" in live.why
    assert not liveness(stale, is_active=lambda h: False).alive


def test_slurmctld_down_is_not_a_finished_job(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: squeue's failure fell through to "SLURM no longer lists the job": not active."""

    class Done:
        def __init__(self, rc: int, out: str = "", err: str = "") -> None:
            self.returncode, self.stdout, self.stderr = rc, out, err

    def run(argv: list[str], **kw: Any) -> Done:
        if argv[0] == "squeue":
            return Done(1, err="slurm_load_jobs error: Unable to contact slurm controller (connect failure)")
        return Done(1, err="sacct: error: Problem talking to the database: Connection refused")

    monkeypatch.setattr(slurm.proc, "run", run)
    answer = slurm.slurm_status("77")
    assert answer.active is None and not answer.answered and "Unable to contact" in answer.reason

    def gone(argv: list[str], **kw: Any) -> Done:
        if argv[0] == "squeue":
            return Done(1, err="slurm_load_jobs error: Invalid job id specified")
        return Done(0, out=json.dumps({"jobs": []}))

    monkeypatch.setattr(slurm.proc, "run", gone)
    assert slurm.slurm_status("77").active is False  # a job SLURM has forgotten really is over


def test_a_refusal_names_the_holder_and_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    paths = RunPaths(tmp_path)
    RunLock(paths).set(_holder("77", age=2 * STALE_AFTER_S))

    class Unreachable:
        def status(self, paths: RunPaths, job_id: str) -> SchedulerStatus:
            return SchedulerStatus(JobState.UNKNOWN, "", "cannot ask SLURM: connect failure", answered=False)

    monkeypatch.setattr(launch, "get_scheduler", lambda kind: Unreachable())
    with pytest.raises(RunLockedError, match="cannot be asked whether job 77 is alive"):
        RunLock(paths).acquire(
            job_id="", scheduler="slurm", role="job", is_active=launch.scheduler_says_active(paths)
        )


def test_two_contenders_taking_over_one_stale_lock_cannot_both_win(tmp_path: Path) -> None:
    """Both judged the same holder stale; before, each renamed "the" lock aside and created its
    own, so the second one threw away the first one's fresh lock and both wrote."""
    lock = RunLock(RunPaths(tmp_path))
    stale = _holder("1", age=2 * STALE_AFTER_S)
    lock.set(stale)
    seen_by_a = seen_by_b = lock.read()
    assert seen_by_a is not None and seen_by_b is not None
    a, b = _holder("A", host="a"), _holder("B", host="b")
    assert lock.take_over(seen_by_a, a)
    assert not lock.take_over(seen_by_b, b)
    assert lock.read().job_id == "A"  # type: ignore[union-attr]
    assert not list(tmp_path.glob("lock.json.takeover-*"))  # the marker is gone


def test_a_continuation_that_adopted_the_lock_is_not_overwritten(tmp_path: Path) -> None:
    """A PBS sweep point: the held continuation is released and adopts the lock before the old
    attempt hands over; the hand-over must not turn it back into a queued job."""
    lock = RunLock(RunPaths(tmp_path))
    old = _holder("12[3]", host="n1")
    lock.set(old)
    lock.set(_holder("40", host="n2"))  # the continuation's agent adopted it
    assert not lock.hand_over(old, "40")
    assert lock.read().role == "agent"  # type: ignore[union-attr]


# ---- 5. watchdog windows scale with the checkpoint ----------------------------------------------


def test_load_and_save_windows_grow_with_the_checkpoint() -> None:
    cfg = load_config(None, []).watchdog
    small = window_s(cfg, "load", stepped=False, recent_max_step_s=None)
    assert small == cfg.checkpoint_s
    tera = CheckpointScale(bytes=10**12, slowest_save_s=0)
    assert window_s(cfg, "load", stepped=False, recent_max_step_s=None, scale=tera) == pytest.approx(
        2 * 1e12 / SLOW_IO_BPS
    )
    small_ckpt = CheckpointScale(bytes=20 * 10**6, slowest_save_s=0.3)  # the configured window stands
    assert window_s(cfg, "save", stepped=True, recent_max_step_s=1, scale=small_ckpt) == cfg.checkpoint_s
    slow = CheckpointScale(bytes=10**6, slowest_save_s=2000)
    assert window_s(cfg, "save", stepped=True, recent_max_step_s=1, scale=slow) >= 3 * 2000
    assert window_s(cfg, "eval", stepped=True, recent_max_step_s=1, scale=tera) == cfg.checkpoint_s


def test_the_scale_comes_from_the_newest_manifest_and_the_measured_saves(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path)
    (paths.checkpoints / "step_000010").mkdir(parents=True)
    (paths.checkpoints / "step_000010" / "manifest.json").write_text(json.dumps({"total_bytes": 123}))
    (paths.checkpoints / "step_000020").mkdir()
    (paths.checkpoints / "step_000020" / "manifest.json").write_text(json.dumps({"total_bytes": 4567}))
    (paths.checkpoints / "step_000030.corrupt").mkdir()
    saves = [
        {"event": "checkpoint_saved", "seconds": 3.5, "bytes": 100},
        {"event": "checkpoint_saved", "seconds": 9},
    ]
    scale = CheckpointScale.of_run(paths, as_events(saves))
    assert (scale.bytes, scale.slowest_save_s) == (4567, 9.0)


# ---- 6. windows where a cancel became a requeue ------------------------------------------------


def test_the_submission_is_recorded_before_the_scheduler_is_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A resumed run's first attempt can start before sbatch/qsub answers: it must already see
    the resubmission in the ledger, or it reads the old end and withdraws itself."""
    cfg = load_config(None, [f"run_dir={tmp_path / 'run'}"])
    prepared = launch.prepare(cfg)
    seen: list[list[str]] = []

    class Recording:
        kind = "local"

        def render(self, plan: Any) -> Any:
            return prepared.rendered

        def status(self, paths: RunPaths, job_id: str) -> SchedulerStatus:
            return SchedulerStatus(JobState.COMPLETED, "completed")

        def submit(self, plan: Any, rendered: Any) -> str:
            seen.append([e["event"] for e in [e.record for e in read_events(plan.paths()).events]])
            return "local1"

    monkeypatch.setattr(launch, "get_scheduler", lambda kind: Recording())
    launch.submit(prepared, run_preflight=True)
    Ledger(prepared.plan.paths(), role="agent").append("finished", cause=None)
    RunLock(prepared.plan.paths()).release()  # the job ended
    launch.submit(prepared, run_preflight=True, resume=True)
    assert seen[1][-1] == "submitting"  # the resume is in the ledger when the scheduler is asked
    story = [
        (e["event"], e["resume"], e.get("job_id"))
        for e in [e.record for e in read_events(prepared.plan.paths()).events]
        if e["event"].startswith("submit")
    ]
    assert story == [
        ("submitting", False, None),
        ("submitted", False, "local1"),
        ("submitting", True, None),
        ("submitted", True, "local1"),
    ]
    between = read_events(prepared.plan.paths()).events[:-1]  # what an attempt starting then saw
    assert decide_start(History.from_events(between)) is None


def test_a_stop_left_from_before_is_dropped_by_a_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = load_config(None, [f"run_dir={tmp_path / 'run'}"])
    prepared = launch.prepare(cfg)

    class Quiet:
        def render(self, plan: Any) -> Any:
            return prepared.rendered

        def status(self, paths: RunPaths, job_id: str) -> SchedulerStatus:
            return SchedulerStatus(JobState.COMPLETED, "completed")

        def submit(self, plan: Any, rendered: Any) -> str:
            return "local2"

    monkeypatch.setattr(launch, "get_scheduler", lambda kind: Quiet())
    launch.submit(prepared, run_preflight=True)
    write_user_stop(prepared.plan.paths(), continue_=False, attempt=None, by="hpclaunch stop")
    RunLock(prepared.plan.paths()).release()  # the job ended
    launch.submit(prepared, run_preflight=True, resume=True)
    assert user_stop(prepared.plan.paths()) is None
    assert any(
        e["event"] == "stop_dropped" for e in [e.record for e in read_events(prepared.plan.paths()).events]
    )


# ---- 7. bad input that reaches a script; names and ports that collide ----------------------------


def test_temporary_names_differ_across_hosts(monkeypatch: pytest.MonkeyPatch) -> None:
    """pids repeat across hosts: two hosts writing the same file used to share ``.x.tmp.<pid>``."""
    from hpclaunch import fsutil

    monkeypatch.setattr(fsutil.os, "getpid", lambda: 1234)
    monkeypatch.setattr(fsutil.socket, "gethostname", lambda: "n1.cluster")
    one = fsutil.unique_suffix()
    monkeypatch.setattr(fsutil.socket, "gethostname", lambda: "n2.cluster")
    two = fsutil.unique_suffix()
    assert one.startswith("n1.1234.") and two.startswith("n2.1234.") and one != two


def test_the_rendezvous_port_is_chosen_per_job(tmp_path: Path) -> None:
    ports = {rdzv_port_for(f"{job}", None) for job in range(1000, 1050)}
    assert len(ports) >= 48 and all(20000 <= p < 32768 for p in ports)
    assert rdzv_port_for("123_4", None) == rdzv_port_for("123_4", None)  # every node derives the same
    assert rdzv_port_for("123_4", 29500) == 29500
    from hpclaunch.jobs.allocation import Roster
    from hpclaunch.jobs.attempt_env import rank_request
    from hpclaunch.orchestrator.plan_build import build

    class Nodes:
        def node_address(self, host: str) -> str:
            return {"n1": "10.0.0.1", "n2": "10.0.0.2"}[host]

    ctx = NodeContext("slurm", "88", 0, 2, "n1", ("n1", "n2"))
    for fixed in (None, 29500):
        cfg = load_config(
            None, ["scheduler.kind=slurm", "scheduler.nodes=2", f"launch.rdzv_port={fixed or 'null'}"]
        )
        run = NodeRun.start(RunPaths(tmp_path), build(cfg, python="python3"), ctx, Nodes())  # type: ignore[arg-type]
        request = rank_request(run, Roster(ctx.hosts))
        assert request["rdzv_endpoint"] == f"10.0.0.1:{rdzv_port_for(ctx.attempt, fixed)}"


# ---- 8. what status says ------------------------------------------------------------------------


def test_a_retried_crash_shows_its_reason() -> None:
    events = [
        {"event": "started", "attempt": "7.0", "ts": 1.0, "node": 0},
        {
            "event": "requeued",
            "attempt": "7.0",
            "ts": 2.0,
            "cause": "crash",
            "reason": "RuntimeError: gloo connection reset",
            "action": "continue",
        },
        {"event": "started", "attempt": "7.1", "ts": 3.0, "node": 0},
        {
            "event": "requeued",
            "attempt": "7.1",
            "ts": 4.0,
            "cause": "timeout",
            "reason": "stopped after step 9 (timeout)",
        },
    ]
    first, second = attempts_from_events(as_events(events))
    assert (first.cause, first.error) == ("crash", "RuntimeError: gloo connection reset")
    assert (second.cause, second.error) == ("timeout", None)  # a stop has nothing to explain


def test_a_bad_token_in_a_batch_is_named_by_the_batch(tmp_path: Path) -> None:
    """A shard rewritten after the start-up check: the batch that reads it says which file, sample
    and id, as the run's own data failure (it used to be an index error: a crash, retried)."""
    from hpclaunch.shards.format import validate_dataset
    from hpclaunch.shards.synth import synth_dataset
    from hpclaunch.trainer.data.dataset import SampleOrder, ShardedDataset
    from hpclaunch.trainer.data.loader import RankDataError, StepBatches, StepPlan, raise_data_problem

    cfg = load_config(None, [])
    synth_dataset(tmp_path / "d", samples=32, model_cfg=cfg.model, seed=0)
    info = validate_dataset(
        tmp_path / "d" / "tokens", tmp_path / "d" / "latents", cfg.model, known_good=set()
    )
    token_file = info.shards[0].token_path
    ids = np.load(token_file)["input_ids"].copy()
    ids[:, 3] = 999
    np.savez(token_file, input_ids=ids)
    dataset = ShardedDataset(info, cfg.model)
    plan = StepPlan(
        seed=0,
        first_step=1,
        first_position=0,
        steps=1,
        global_batch=4,
        rank=0,
        per_rank=4,
        micro=4,
        pad_id=None,
    )
    item = StepBatches(dataset, SampleOrder(dataset.num_samples, 0), plan)[0]
    with pytest.raises(RankDataError, match=r"id 999 at sample \d+, position 3 is outside 0..255") as caught:
        raise_data_problem(item)
    assert caught.value.where == str(token_file)


def test_a_save_that_failed_because_a_peer_died_in_it_is_that_peers_crash_not_the_runs_verdict() -> None:
    """Seen under load (local scheduler): rank 0 SIGKILLed during the last save; rank 1's save
    failed with gloo's "Connection closed by peer", a CheckpointError, so cause `training`: the run
    failed instead of restarting in place within the crash budget."""
    import torch.distributed as dist

    from hpclaunch.errors import CheckpointError
    from hpclaunch.trainer.entry import failure_cause

    gloo = (
        "/runs/crash/checkpoints: writing step 60 failed: RuntimeError: [/__w/pytorch/pytorch/third_party/"
        "gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:27539"
    )
    assert failure_cause(CheckpointError(gloo)) is Cause.CRASH
    try:
        try:
            raise dist.DistNetworkError("recv: the socket is gone")
        except dist.DistNetworkError as e:
            raise CheckpointError("writing step 60 failed") from e
    except CheckpointError as chained:
        assert failure_cause(chained) is Cause.CRASH
    full = CheckpointError(
        "no space left on /runs/x/checkpoints: 12.0 MiB free, the checkpoint needs 230.0 MiB"
    )
    assert failure_cause(full) is Cause.TRAINING  # the run's own: a retry would fail the same way
