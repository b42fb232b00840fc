"""The trainer under torch's elastic launcher: 2 gloo ranks, the real mmdit model, synthetic data.

One reference run (60 steps, seed 0) is shared: its losses must fall, a rerun must match it
bitwise, and a run stopped through the control file and restarted must end bitwise equal to it.
The stop's first attempt and the failed run are started by a plain torchrun (every rank its own
interpreter: the trainer as a user's torchrun starts it); the rest fork their ranks from a
launcher that imported the trainer once (``helpers/preloaded_torchrun.py``), as the rank host does.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from hpclaunch.rundir import RunPaths
from hpclaunch.rundir.control import write_user_stop

sys.path.insert(0, str(Path(__file__).parent / "helpers"))
import trainer_helpers as h

pytestmark = pytest.mark.slow

FAILED_LINE = "hpclaunch: training failed: "


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("trainer")


@pytest.fixture(scope="module")
def data(root: Path) -> Path:
    return h.make_data(root)


@pytest.fixture(scope="module")
def reference(root: Path, data: Path) -> Path:
    run = h.make_run(root, "reference", data)
    proc = h.train(run)
    assert proc.returncode == 0, h.describe(proc)
    return run


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def test_two_ranks_train_and_both_losses_fall(reference: Path) -> None:
    out = h.outcome(reference)
    assert out["status"] == "finished" and out["cause"] is None and out["error"] is None
    assert out["step"] == 60 and out["world_size"] == 2 and out["samples_consumed"] == 60 * 16
    assert [r["rank"] for r in out["ranks"]] == [0, 1]
    assert len({r["params_sha256"] for r in out["ranks"]}) == 1  # DDP replicas agree
    lines = h.metrics(reference)
    assert [line["step"] for line in lines] == list(range(1, 61))
    for key in ("text_loss", "latent_loss"):
        values = [line[key] for line in lines]
        assert mean(values[-10:]) < 0.85 * mean(values[:10]), (key, values)
    resumed = [e for e in h.events(reference) if e["event"] == "resumed"]
    assert len(resumed) == 1
    assert {
        k: resumed[0][k] for k in ("step", "checkpoint", "world_size", "samples_consumed", "attempt")
    } == {
        "step": 0,
        "checkpoint": None,
        "world_size": 2,
        "samples_consumed": 0,
        "attempt": "a1",
    }


def test_same_seed_is_bitwise_identical_and_another_seed_is_not(
    reference: Path, root: Path, data: Path
) -> None:
    again = h.make_run(root, "again", data)
    other = h.make_run(root, "other-seed", data, ["train.seed=1"])
    for run in (again, other):
        proc = h.train(run)
        assert proc.returncode == 0, h.describe(proc)
    ref = h.outcome(reference)["params_sha256"]
    assert h.outcome(again)["params_sha256"] == ref
    assert h.outcome(other)["params_sha256"] != ref


@pytest.mark.parametrize(("mode", "clean"), [("l2t", "latent_loss"), ("t2l", "text_loss")])
def test_one_sided_modes_train_under_ddp(root: Path, data: Path, mode: str, clean: str) -> None:
    """DDP copes with the clean side's unused head and last-block branch (find_unused_parameters)."""
    run = h.make_run(root, f"mode-{mode}", data, ["train.steps=10", f"train.mode={mode}"])
    proc = h.train(run)
    assert proc.returncode == 0, h.describe(proc)
    out = h.outcome(run)
    assert out["status"] == "finished" and len({r["params_sha256"] for r in out["ranks"]}) == 1
    assert all(line[clean] == 0.0 for line in h.metrics(run))


def test_injected_nonfinite_steps_are_skipped_together_on_every_rank(root: Path, data: Path) -> None:
    run = h.make_run(root, "inject", data, ["train.steps=12", "testing.inject_nonfinite_at=[3, 7, 8]"])
    proc = h.train(run)
    assert proc.returncode == 0, h.describe(proc)
    out = h.outcome(run)
    assert out["status"] == "finished" and out["step"] == 12 and out["skipped"] == 3
    assert [r["skipped"] for r in out["ranks"]] == [3, 3]
    assert all(r["params_finite"] for r in out["ranks"])
    assert len({r["params_sha256"] for r in out["ranks"]}) == 1
    lines = h.metrics(run)
    assert [line["skipped"] for line in lines] == [0, 0, 1, 1, 1, 1, 2, 3, 3, 3, 3, 3]
    assert [line["loss"] is None for line in lines] == [s in (3, 7, 8) for s in range(1, 13)]


def test_too_many_consecutive_nonfinite_steps_fail_the_run(root: Path, data: Path) -> None:
    run = h.make_run(
        root,
        "fail",
        data,
        ["train.steps=10", "testing.inject_nonfinite_at=[2, 3]", "train.max_nonfinite_skips=2"],
    )
    proc = h.train(run, plain_torchrun=True)
    assert proc.returncode != 0
    reason = "2 consecutive non-finite steps (the last at step 3); train.max_nonfinite_skips is 2"
    ours = [line for line in proc.stderr.splitlines() if FAILED_LINE in line]
    assert ours == [FAILED_LINE + reason], h.describe(proc)  # once, from rank 0
    out = h.outcome(run)
    assert out["status"] == "failed" and out["error"] == reason and out["step"] == 3
    assert [r["skipped"] for r in out["ranks"]] == [2, 2]


def test_single_process_failure_is_one_line_without_traceback(root: Path, data: Path) -> None:
    run = h.make_run(
        root,
        "fail-single",
        data,
        [
            "scheduler.procs_per_node=1",
            "train.steps=8",
            "testing.inject_nonfinite_at=[1]",
            "train.max_nonfinite_skips=1",
        ],
    )
    proc = h.train(run, nproc=0)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        FAILED_LINE + "1 consecutive non-finite steps (the last at step 1); train.max_nonfinite_skips is 1"
    ], h.describe(proc)
    assert h.outcome(run)["world_size"] == 1


def test_stop_file_stops_both_ranks_after_the_same_step_and_resume_is_exact(
    reference: Path, root: Path, data: Path
) -> None:
    run = h.make_run(root, "stopped", data, ["testing.step_sleep_s=0.1"])  # same math as the reference
    proc = h.start(run, attempt="a1", plain_torchrun=True)
    h.wait_for_step(run, 4, proc)
    write_user_stop(RunPaths(run), continue_=False, attempt=None, by="test")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    out = h.outcome(run, "a1")
    k = out["step"]
    assert out["status"] == "stopped" and out["cause"] == "user" and out["error"] is None
    assert 4 <= k < 60
    assert [r["step"] for r in out["ranks"]] == [k, k]
    assert h.metrics(run)[-1]["step"] == k
    stopped = [e for e in h.events(run) if e["event"] == "stopped"]
    assert [(e["cause"], e["step"], e["attempt"]) for e in stopped] == [("user", k, "a1")]
    assert (RunPaths(run).checkpoints / f"step_{k:06d}").is_dir()

    # A copy resumes on one rank (same global batch): it continues from the same data position.
    RunPaths(run).stop_file.unlink()
    single = root / "stopped-on-one-rank"
    shutil.copytree(run, single)

    # The original resumes on two ranks (no sleep this time) and ends exactly like the reference.
    h.make_run(root, "stopped", data)
    proc2 = h.train(run, attempt="a2")
    assert proc2.returncode == 0, h.describe(proc2)
    out2 = h.outcome(run, "a2")
    assert out2["status"] == "finished" and out2["step"] == 60
    assert out2["params_sha256"] == h.outcome(reference)["params_sha256"]
    resumed = [e for e in h.events(run) if e["event"] == "resumed" and e["attempt"] == "a2"]
    assert resumed[0]["step"] == k and resumed[0]["samples_consumed"] == 16 * k
    assert resumed[0]["checkpoint"] == str(RunPaths(run).checkpoints / f"step_{k:06d}")
    steps = [line["step"] for line in h.metrics(run)]
    assert steps == list(range(1, 61))  # no step lost, none repeated

    proc3 = h.train(single, nproc=0, attempt="a2")
    assert proc3.returncode == 0, h.describe(proc3)
    out3 = h.outcome(single, "a2")
    assert out3["status"] == "finished" and out3["world_size"] == 1 and out3["samples_consumed"] == 60 * 16
    resumed = [e for e in h.events(single) if e["event"] == "resumed" and e["attempt"] == "a2"]
    assert (resumed[0]["step"], resumed[0]["world_size"]) == (k, 1)
