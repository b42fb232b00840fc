"""The whole stop -> save -> requeue -> resume cycle on the embedded local scheduler, for real:
the CLI, the detached controller, the node agent, torchrun with 2 gloo ranks, DCP checkpoints."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import psutil
import pytest
from tests.runlib import (
    TINY,
    events,
    final_params_sha,
    hpclaunch,
    rank_process,
    status,
    synth_data,
    tiny_overrides,
    wait_for,
    wait_run_done,
)

from hpclaunch.rundir import RunPaths, read_events

pytestmark = pytest.mark.slow

STEPS = 300
SLOW = (
    f"train.steps={STEPS}",
    "testing.step_sleep_s=0.1",
    "train.log_every=1",
    "checkpoint.every_steps=30",
    "launch.stop_margin_s=3",
)


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("local-runs")


@pytest.fixture(scope="module")
def data(work: Path) -> Path:
    return synth_data(work / "data")


def _last_step(run: Path) -> int:
    path = run / "metrics.jsonl"
    if not path.exists():
        return 0
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return int(lines[-1]["step"]) if lines else 0


def _attempts(run: Path) -> int:
    return len({e["attempt"] for e in events(run) if e["event"] == "started"})


def _worker(run: Path, rank: int) -> psutil.Process:
    return rank_process(run, rank)


def _wait_step(run: Path, step: int, attempt: int) -> None:
    def reached() -> bool:
        return _attempts(run) >= attempt and _last_step(run) >= step

    wait_for(reached, timeout=180, poll=0.2, what=f"step {step} in attempt {attempt}")


def _load_final_checkpoint(run: Path, tmp: Path) -> dict[str, Any]:
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    newest = sorted((run / "checkpoints").glob("step_*"))[-1]
    out = tmp / f"{run.name}.pt"
    dcp_to_torch_save(newest, out)
    state: dict[str, Any] = torch.load(out, weights_only=False)  # our own conversion of our own file
    return state


def _flat(prefix: str, obj: Any) -> dict[str, Any]:
    if isinstance(obj, dict):
        out: dict[str, Any] = {}
        for k, v in obj.items():
            out.update(_flat(f"{prefix}.{k}", v))
        return out
    return {prefix: obj}


@pytest.mark.timeout(1200)  # (three attempts and a reference: CI's busy cores took 512 s)
def test_three_kinds_of_stop_then_bitwise_equal_params_and_optimizer(
    work: Path, data: Path, tmp_path: Path
) -> None:
    """Stopped by the control file, by SIGTERM to ONE worker, and by the deadline; resumed each time."""
    import torch

    ref = tiny_overrides(work, data, "uninterrupted", *SLOW, "testing.step_sleep_s=0")
    hpclaunch("train", str(TINY), *ref, cwd=work, timeout=600)

    run = work / "runs" / "stopped3"
    overrides = tiny_overrides(
        work, data, "stopped3", *SLOW, "scheduler.time_limit=45s", "scheduler.kill_wait_s=20"
    )
    hpclaunch("submit", str(TINY), *overrides, "--no-preflight", cwd=work)

    # the first two stops come early in their attempts, far from the deadline whatever the start-up
    _wait_step(run, 5, attempt=1)
    hpclaunch("stop", str(run), "--continue", cwd=work)  # 1: the control file (user, continue)

    _wait_step(run, _last_step(run) + 5, attempt=2)
    _worker(run, rank=1).send_signal(signal.SIGTERM)  # 2: a signal that reaches one rank only

    # 3: attempt 3 runs into its deadline (45 s limit minus the measured save time and a margin):
    # the ~290 steps left take ~35 s of training at 0.1 s/step, more than one attempt holds
    s = wait_run_done(run, work, timeout=600)
    assert s["state"] == "finished", json.dumps(s, indent=1)[-3000:]
    causes = [(a["end"], a["cause"]) for a in s["attempts"]]
    story = "\n".join(json.dumps(e) for e in events(run))
    assert causes[:3] == [("requeued", "user"), ("requeued", "preemption"), ("requeued", "timeout")], story
    assert causes[-1] == ("finished", None)
    assert s["step_counts"]["repeated_steps"] == 0 and s["step_counts"]["lost_steps"] == 0
    assert s["step_counts"]["useful_steps"] == STEPS

    # every rank stopped after the same step, although only rank 1 got the signal
    outcomes = [json.loads(p.read_text()) for p in (run / "attempts").glob("*.json")]
    for o in outcomes:
        assert len({r["step"] for r in o["ranks"]}) == 1, o

    assert final_params_sha(run) == final_params_sha(work / "runs" / "uninterrupted")
    a = _flat("", _load_final_checkpoint(run, tmp_path))
    b = _flat("", _load_final_checkpoint(work / "runs" / "uninterrupted", tmp_path))
    tensors = [
        k for k in a if isinstance(a[k], torch.Tensor) and (k.startswith(".optim") or k.startswith(".model"))
    ]
    assert any(".optim.state" in k for k in tensors)
    for key in tensors:
        assert torch.equal(a[key], b[key]), key


def test_a_crash_is_restarted_in_place_within_its_own_budget_bitwise_equal(work: Path, data: Path) -> None:
    """Issue 17 (a), local scheduler: a rank SIGKILLed mid-run. The agent restarts the attempt in
    place (no new job, no controller restart) from the last checkpoint, spending the crash budget,
    and the run ends bitwise equal to one that never crashed."""
    # 120 steps: on two busy cores the step-30 save (its writer at idle priority) may commit only
    # when the step-60 save waits for it; the kill must still land mid-run, not in the last save.
    ref = tiny_overrides(work, data, "crash-ref", *SLOW, "train.steps=120", "testing.step_sleep_s=0")
    hpclaunch("train", str(TINY), *ref, cwd=work, timeout=600)
    run = work / "runs" / "crash"
    overrides = tiny_overrides(
        work, data, "crash", *SLOW, "train.steps=120", "scheduler.max_failure_retries=1"
    )
    hpclaunch("submit", str(TINY), *overrides, "--no-preflight", cwd=work)
    # Past the checkpoint at step 30 *committed* (saves run in the background: reaching step 35
    # does not mean the step-30 save is on disk yet on a loaded machine): the restart loads it.
    wait_for(
        lambda: any(e["event"] == "checkpoint_saved" and e.get("step") == 30 for e in events(run)),
        timeout=180,
        poll=0.1,
        what="the checkpoint at step 30",
    )
    _worker(run, rank=0).send_signal(signal.SIGKILL)  # what an OOM kill or a segfault looks like
    s = wait_run_done(run, work, timeout=300)
    assert s["state"] == "finished", json.dumps(s, indent=1)[-3000:]
    first, second = s["attempts"]
    assert (first["end"], first["cause"]) == ("restarted in place", "crash")
    assert first["job_id"] == second["job_id"] and second["in_place"]
    assert second["resumed_step"] in (30, 60)  # the newest committed when the rank died
    story = events(run)
    decided = [e for e in story if e["event"] == "requeued"]
    assert [(e["cause"], e["in_place"], e["counts_as"]) for e in decided] == [("crash", True, "crash")]
    assert [e["restart_count"] for e in story if e["event"] == "started"] == [0, 0]  # no new allocation
    assert json.loads((run / "scheduler" / "local.json").read_text())["restart_count"] == 0
    assert "preemption" not in {a["cause"] for a in s["attempts"]}
    assert final_params_sha(run) == final_params_sha(work / "runs" / "crash-ref")


def test_max_requeues_is_honoured(work: Path, data: Path) -> None:
    run = work / "runs" / "budget"
    # ~50 s of training at 0.1 s/step: at least three 30 s attempts, but only one requeue is allowed
    overrides = tiny_overrides(
        work, data, "budget", *SLOW, "train.steps=400", "scheduler.time_limit=30s", "scheduler.max_requeues=1"
    )
    hpclaunch("submit", str(TINY), *overrides, "--no-preflight", cwd=work)
    s = wait_run_done(run, work, timeout=300)
    assert s["state"] == "failed", json.dumps(s, indent=1)[-3000:]
    ends = [(a["end"], a["cause"]) for a in s["attempts"]]
    assert ends == [("requeued", "timeout"), ("failed", "timeout")], ends
    assert "1 requeues used of 1" in s["attempts"][-1]["error"]
    # the run kept its progress: a later `submit --resume` continues from the last save
    assert s["attempts"][-1]["checkpoint_step"] == s["step"]


def test_user_stop_ends_the_run_and_resume_continues_it(work: Path, data: Path) -> None:
    run = work / "runs" / "userstop"
    overrides = tiny_overrides(work, data, "userstop", *SLOW, "train.steps=60")
    hpclaunch("submit", str(TINY), *overrides, "--no-preflight", cwd=work)
    _wait_step(run, 10, attempt=1)
    hpclaunch("stop", str(run), cwd=work)
    s = wait_run_done(run, work, timeout=120)
    assert s["state"] == "stopped" and s["attempts"][0]["cause"] == "user"
    assert not (run / "control" / "stop").exists()  # consumed: the next attempt starts clean
    hpclaunch("submit", "--resume", str(run), "--no-preflight", cwd=work)
    s = wait_run_done(run, work, timeout=300)
    assert s["state"] == "finished" and s["step"] == 60
    assert s["attempts"][1]["resumed_step"] == s["attempts"][0]["last_step"]
    # the run's end carries its step (issue 16, finding 8: the old `finished` event had none)
    (finished,) = [e.record for e in read_events(RunPaths(run)).named("finished")]
    assert finished["step"] == 60


def test_status_json_and_logs_of_a_run(work: Path) -> None:
    run = work / "runs" / "userstop"
    data = status(run, work)
    assert {"state", "attempts", "goodput", "step", "loss", "eta_s"} <= set(data)
    log = hpclaunch("logs", str(run), "--attempt", "1", cwd=work).stdout
    assert "hpclaunch attempt" in log and "step" in log
    bad = hpclaunch("logs", str(run), "--attempt", "9", cwd=work, check=False)
    assert bad.returncode == 2 and "attempt 9 does not exist" in bad.stderr


def test_submit_refuses_a_config_whose_preflight_fails(work: Path, data: Path) -> None:
    # A check that fails: 1, with the table. (Missing data is bad input: 2, one line, before it.)
    overrides = tiny_overrides(work, data, "refused", "scheduler.mem_gb=0.001")  # 1 MB
    result = hpclaunch("submit", str(TINY), *overrides, cwd=work, check=False)
    assert result.returncode == 1, result.stderr
    assert "preflight check 'config' failed" in result.stderr and "nothing was submitted" in result.stderr
    assert not (work / "runs" / "refused").exists()
    overrides = tiny_overrides(work, data, "refused", "data.token_dir=/nonexistent/tokens")
    result = hpclaunch("submit", str(TINY), *overrides, cwd=work, check=False)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(
        "hpclaunch: error: --set: data.token_dir: /nonexistent/tokens does not exist"
    )
    assert len(result.stderr.strip().splitlines()) == 2 and not (work / "runs" / "refused").exists()


def test_hpclaunch_cancel_ends_the_run_as_cancelled_not_requeued(work: Path, data: Path) -> None:
    run = work / "runs" / "cancelme"
    hpclaunch("submit", str(TINY), *tiny_overrides(work, data, "cancelme", *SLOW), "--no-preflight", cwd=work)
    wait_for(lambda: any(e["event"] == "resumed" for e in events(run)), timeout=120, what="training to start")
    hpclaunch("cancel", str(run), cwd=work)
    s = wait_run_done(run, work, timeout=120)
    assert s["state"] == "cancelled", json.dumps(s, indent=1)[-3000:]
    story = "\n".join(json.dumps(e) for e in events(run))
    assert not any(e["event"] in ("requeued", "failed") for e in events(run)), story
    # The cancel's SIGTERM reaches every process of the job, as on SLURM (DataLoader workers
    # included): the ranks still stop together and save, so `submit --resume` loses nothing.
    stopped = [e for e in events(run) if e["event"] == "stopped"]
    assert stopped, story
    assert (run / "checkpoints" / f"step_{stopped[-1]['step']:06d}" / "manifest.json").is_file(), story


def test_a_local_sweep_runs_every_point_to_the_end(work: Path, data: Path) -> None:
    overrides = tiny_overrides(work, data, "lsweep", "train.steps=20", "train.warmup_steps=5")
    hpclaunch(
        "submit", str(TINY), *overrides, "--sweep", "train.lr=1e-3,5e-4", "--no-preflight", "--wait", cwd=work
    )
    table = json.loads(hpclaunch("status", str(work / "runs" / "lsweep"), "--json", cwd=work).stdout)
    assert [(Path(p["run"]).name, p["state"], p["step"]) for p in table["points"]] == [
        ("p0-lr1e-3", "finished", 20),
        ("p1-lr5e-4", "finished", 20),
    ]


def test_a_second_writer_is_refused_while_the_run_is_active(work: Path, data: Path) -> None:
    """`train --resume` and `submit --resume` on a run whose local job still runs: refused, one line."""
    run = work / "runs" / "locked"
    # (long enough never to end by itself before the stop below: 60 steps ended under load first)
    overrides = tiny_overrides(work, data, "locked", *SLOW, "train.steps=3000")
    hpclaunch("submit", str(TINY), *overrides, "--no-preflight", cwd=work)
    wait_for(lambda: any(e["event"] == "resumed" for e in events(run)), timeout=120, what="training to start")
    for argv in (
        ["train", str(TINY), *overrides, "--resume"],
        ["submit", "--resume", str(run), "--no-preflight"],
    ):
        refused = hpclaunch(*argv, cwd=work, check=False)
        assert refused.returncode == 2, refused.stdout + refused.stderr
        assert "this run is active: local job local" in refused.stderr, refused.stderr
        assert "Traceback" not in refused.stderr
    ranks = [rank_process(run, r) for r in (0, 1)]
    assert all(p.is_running() for p in ranks)  # still the one job's 2 ranks, no second writer
    agents = [
        p for p in psutil.process_iter(["cmdline"]) if "hpclaunch.jobs.agent" in (p.info["cmdline"] or [])
    ]
    assert len([p for p in agents if str(run) in " ".join(p.info["cmdline"])]) == 1
    hpclaunch("stop", str(run), cwd=work)
    s = wait_run_done(run, work, timeout=120)
    assert s["state"] == "stopped"
    assert not (run / "lock.json").exists()  # the controller released it when the job ended


def test_a_corrupt_shard_is_a_data_error_naming_the_file_not_a_node_failure(work: Path, data: Path) -> None:
    import shutil

    bad = work / "bad-data"
    shutil.copytree(data, bad)
    shard = sorted((bad / "tokens").glob("*.npz"))[0]
    shard.write_bytes(shard.read_bytes()[:100])  # truncated, as by a failed copy
    run = work / "runs" / "baddata"
    overrides = tiny_overrides(work, bad, "baddata", "train.steps=20", "train.warmup_steps=5")
    hpclaunch("submit", str(TINY), *overrides, "--no-preflight", cwd=work)
    s = wait_run_done(run, work, timeout=120)
    assert s["state"] == "failed", json.dumps(s, indent=1)[-3000:]
    last = s["attempts"][-1]
    assert last["cause"] == "data" and shard.name in last["error"], last
    assert not any(e["event"] in ("node_excluded", "requeued") for e in events(run))


def test_train_ends_with_the_trainers_reason_and_keeps_torchruns_report_in_the_log(
    work: Path, data: Path
) -> None:
    overrides = tiny_overrides(
        work,
        data,
        "fgfail",
        "train.steps=10",
        "train.warmup_steps=2",
        "testing.inject_nonfinite_at=[1, 2]",
        "train.max_nonfinite_skips=2",
    )
    result = hpclaunch("train", str(TINY), *overrides, cwd=work, check=False)
    assert result.returncode == 1
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("hpclaunch: training failed: 2 consecutive non-finite steps"), lines[-3:]
    shown = result.stdout + result.stderr
    assert "ChildFailedError" not in shown and "Traceback" not in shown
    log = next((work / "runs" / "fgfail" / "logs").glob("attempt-*/node0.log")).read_text()
    assert "ChildFailedError" in log  # the rank host's own report is kept, in the log


def test_train_in_the_foreground_restarts_a_crash_in_place(work: Path, data: Path) -> None:
    import subprocess
    import sys

    run = work / "runs" / "fgcrash"
    overrides = tiny_overrides(
        work, data, "fgcrash", *SLOW, "train.steps=40", "scheduler.max_failure_retries=1"
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "hpclaunch", "train", str(TINY), *overrides],
        cwd=work,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_step(run, 10, attempt=1)
        _worker(run, rank=0).send_signal(signal.SIGKILL)
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, out[-2000:] + err[-2000:]
    assert "restarting in place (1 of 1 failure retries)" in err
    story = events(run)
    assert [(e["cause"], e["in_place"]) for e in story if e["event"] == "requeued"] == [("crash", True)]
    started = [e for e in story if e["event"] == "started"]
    assert [e["restart_count"] for e in started] == [0, 0] and started[1]["in_place"]
    assert any(e["event"] == "finished" for e in story)


def test_a_stop_save_that_overruns_the_kill_wait_is_cut_short_and_decided(work: Path, data: Path) -> None:
    """The stop save takes longer than the scheduler's kill wait (a test hook delays the writer):
    node 0 ends the attempt a few seconds before the SIGKILL and still decides, instead of dying
    undecided and leaving the run lost."""
    run = work / "runs" / "overrun"
    overrides = tiny_overrides(
        work,
        data,
        "overrun",
        "train.steps=2000",
        "testing.step_sleep_s=0.05",
        "checkpoint.every_steps=5000",
        "scheduler.time_limit=20s",
        "scheduler.kill_wait_s=8",
        "scheduler.max_requeues=1",
        "launch.stop_margin_s=2",
        "launch.env.HPCLAUNCH_TEST_CKPT_DELAY_WRITE_S=30",
    )
    hpclaunch("submit", str(TINY), *overrides, "--no-preflight", cwd=work)
    s = wait_run_done(run, work, timeout=240)
    story = events(run)
    assert [e["cause"] for e in story if e["event"] == "stop_overdue"] == ["timeout", "timeout"], story
    requeued = [e for e in story if e["event"] == "requeued"]
    assert [e["cause"] for e in requeued] == ["timeout"] and "before the attempt could save" in requeued[0][
        "reason"
    ]
    assert s["state"] == "failed" and "1 requeues used of 1" in s["attempts"][-1]["error"], s


def test_the_time_limit_warning_during_saves_fails_no_save(work: Path, data: Path) -> None:
    """Issue 26's repro: the local scheduler sends SIGUSR2 to every process of the job while the
    ranks save every 2 steps; the checkpoint writers (helpers of the ranks, like the DataLoader
    workers) must outlive it, so no save fails and none is retried."""
    run = work / "runs" / "warned"
    overrides = tiny_overrides(
        work,
        data,
        "warned",
        "train.steps=120",  # 24 s of steps: the first 30 s attempt is warned before it ends
        "testing.step_sleep_s=0.2",
        "testing.step_sleep_resumed=false",  # the resumed attempts end soon, however loaded the machine
        "scheduler.time_limit=30s",
        "launch.stop_margin_s=2",
        "checkpoint.every_steps=2",
    )
    hpclaunch("submit", str(TINY), *overrides, "--no-preflight", "--wait", cwd=work)
    story = "\n".join(json.dumps(e) for e in events(run))
    assert not [e for e in events(run) if e["event"] == "checkpoint_failed"], story
    s = status(run, work)
    assert s["state"] == "finished" and s["step"] == 120, story
    assert s["attempts"][0]["cause"] == "timeout", story  # the warning came in attempt 1
    assert s["failed_saves"] is None and all(a["failed_saves"] == 0 for a in s["attempts"])
