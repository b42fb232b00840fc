"""The loop in one process (world size 1): LR schedule, NaN guard bookkeeping, modes, metrics."""

from __future__ import annotations

import itertools
import json
import math
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from tests.unit.tiny_model import tiny_model

from hpclaunch.config import RunConfig, load_config
from hpclaunch.errors import TrainingError
from hpclaunch.fsutil import read_jsonl
from hpclaunch.rundir import RunPaths, read_events
from hpclaunch.rundir.clock import AttemptClock
from hpclaunch.rundir.control import write_user_stop
from hpclaunch.shards import synth_dataset
from hpclaunch.trainer.entry import main
from hpclaunch.trainer.loop import Trainer, lr_at, params_sha256
from hpclaunch.trainer.reporting.metrics_window import FIELDS

MODEL = tiny_model(1)

pytestmark = pytest.mark.usefixtures("in_process_trainer")


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("data")
    synth_dataset(root, samples=256, seed=0, model_cfg=load_config(None, MODEL).model, shard_size=100)
    return root


def config(tmp_path: Path, data: Path, *overrides: str) -> RunConfig:
    return load_config(
        None,
        [
            *MODEL,
            "scheduler.procs_per_node=1",
            "train.steps=40",
            "train.global_batch=16",
            "train.lr=3e-3",
            "train.warmup_steps=3",
            "train.log_every=1",
            "preflight.distributed_smoke=false",
            f"data.token_dir={data / 'tokens'}",
            f"data.latent_dir={data / 'latents'}",
            *overrides,
        ],
        base=tmp_path,
    )


def trainer(tmp_path: Path, data: Path, *overrides: str) -> Trainer:
    cfg = config(tmp_path, data, *overrides)
    return Trainer(cfg, RunPaths(tmp_path / "run").ensure(), checkpoints=False, echo=False)


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def test_lr_warmup_then_cosine_to_min_ratio() -> None:
    t = load_config(
        None, ["train.lr=1.0", "train.warmup_steps=10", "train.steps=110", "train.min_lr_ratio=0.1"]
    ).train
    assert lr_at(1, t) == pytest.approx(0.1)
    assert lr_at(10, t) == pytest.approx(1.0)
    assert lr_at(60, t) == pytest.approx(0.55)  # half way down the cosine
    assert lr_at(110, t) == pytest.approx(0.1)
    steps = [lr_at(s, t) for s in range(10, 111)]
    assert all(a >= b for a, b in itertools.pairwise(steps))
    no_warmup = load_config(None, ["train.lr=2.0", "train.warmup_steps=0", "train.steps=5"]).train
    assert lr_at(1, no_warmup) == pytest.approx(0.1 * 2 + 0.9 * 2 * 0.5 * (1 + math.cos(math.pi / 5)))


def test_skipped_step_leaves_model_and_optimizer_untouched(tmp_path: Path, data: Path) -> None:
    tr = trainer(tmp_path, data, "testing.inject_nonfinite_at=[2]")
    applied, *_ = tr.train_step()
    assert applied
    before = params_sha256(tr.model)
    adam_steps = {float(s["step"]) for s in tr.opt.state.values()}
    applied, _, _, _, norm = tr.train_step()
    assert not applied and not math.isfinite(norm.item())
    assert params_sha256(tr.model) == before
    assert {float(s["step"]) for s in tr.opt.state.values()} == adam_steps == {1.0}
    c = tr.counters
    assert (c.step, c.samples_consumed, c.skipped_total, c.nonfinite_consecutive) == (2, 32, 1, 1)
    assert all(p.grad is None for p in tr.model.parameters())
    applied, *_ = tr.train_step()
    assert applied and tr.counters.nonfinite_consecutive == 0 and tr.counters.skipped_total == 1
    tr.close()


def test_injected_steps_are_skipped_counted_and_logged(tmp_path: Path, data: Path) -> None:
    tr = trainer(tmp_path, data, "train.steps=8", "testing.inject_nonfinite_at=[3, 4, 7]")
    out = tr.run()
    tr.close()
    assert out.status == "finished" and out.step == 8
    assert out.extra["skipped"] == 3 and out.extra["ranks"][0]["params_finite"]
    lines = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [line["step"] for line in lines] == list(range(1, 9))
    assert [line["skipped"] for line in lines] == [0, 0, 1, 2, 2, 2, 3, 3]
    assert [line["loss"] is None for line in lines] == [s in (3, 4, 7) for s in range(1, 9)]
    assert all(set(line) == set(FIELDS) for line in lines)
    json.dumps(lines, allow_nan=False)  # strict JSON: no NaN ever written


def test_too_many_consecutive_skips_fail_the_run(tmp_path: Path, data: Path) -> None:
    tr = trainer(
        tmp_path,
        data,
        "train.steps=10",
        "testing.inject_nonfinite_at=[2, 4, 5, 6]",
        "train.max_nonfinite_skips=3",
    )
    with pytest.raises(TrainingError, match=r"3 consecutive non-finite steps \(the last at step 6\)"):
        tr.run()
    tr.close()
    assert tr.counters.step == 6 and tr.counters.skipped_total == 4
    assert read_jsonl(tmp_path / "run" / "metrics.jsonl")[-1]["step"] == 6


@pytest.mark.parametrize(("mode", "live", "clean", "head"), [("l2t", "text_loss", "latent_loss", "latent_head"), ("t2l", "latent_loss", "text_loss", "text_head")])  # fmt: skip
def test_modes_train_the_generated_side_only(
    tmp_path: Path, data: Path, mode: str, live: str, clean: str, head: str
) -> None:
    tr = trainer(tmp_path, data, f"train.mode={mode}")
    head_before = {k: v.clone() for k, v in getattr(tr.model, head).state_dict().items()}
    trunk_before = params_sha256(tr.model.trunk)
    out = tr.run()
    tr.close()
    assert out.status == "finished"
    lines = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert all(line[clean] == 0.0 for line in lines)
    values = [line[live] for line in lines]
    assert mean(values[-10:]) < 0.9 * mean(values[:10]), values
    after = getattr(tr.model, head).state_dict()
    assert all(torch.equal(after[k], v) for k, v in head_before.items())  # no gradient, no decay
    assert params_sha256(tr.model.trunk) != trunk_before


def test_joint_mode_both_losses_fall_in_process(tmp_path: Path, data: Path) -> None:
    tr = trainer(tmp_path, data, "train.steps=60")
    tr.run()
    tr.close()
    lines = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    for key in ("text_loss", "latent_loss"):
        values = [line[key] for line in lines]
        assert mean(values[-10:]) < 0.9 * mean(values[:10]), (key, values)
    assert lines[-1]["samples_per_s"] > 0 and lines[-1]["tokens_per_s"] == pytest.approx(
        lines[-1]["samples_per_s"] * (16 + 4)
    )


def test_same_seed_same_parameters_in_process(tmp_path: Path, data: Path) -> None:
    def final(seed: int, sub: str) -> str:
        tr = trainer(tmp_path / sub, data, "train.steps=5", f"train.seed={seed}", "train.micro_batch=4")
        out = tr.run()
        tr.close()
        return str(out.extra["params_sha256"])

    assert final(0, "a") == final(0, "b") != final(1, "c")


def write_run(tmp_path: Path, data: Path, *overrides: str) -> Path:
    cfg = config(tmp_path, data, *overrides)
    run = RunPaths(tmp_path / "run").ensure()
    run.config.write_text(cfg.to_yaml())
    return run.root


def test_entry_point_reads_attempt_and_deadline_from_the_environment(
    tmp_path: Path, data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = write_run(tmp_path, data, "train.steps=20")
    monkeypatch.setenv("HPCLAUNCH_ATTEMPT", "job7.1")
    past = AttemptClock.build(  # already past: stop at once
        start=time.time() - 100,
        limit_s=99,
        scheduler_end=None,
        warn_lead_s=10,
        stop_lead_fixed_s=None,
        margin_s=1,
        save_estimate_s=1,
    )
    for name, value in past.to_env().items():
        monkeypatch.setenv(name, value)
    assert main([str(run)]) == 0
    out = json.loads(RunPaths(run).outcome_file("job7.1").read_text())
    assert {k: out[k] for k in ("status", "cause", "step", "error", "world_size")} == {
        "status": "stopped",
        "cause": "timeout",
        "step": 1,
        "error": None,
        "world_size": 1,
    }
    events = [e.record for e in read_events(RunPaths(run)).events]
    assert [e["event"] for e in events if e["event"] != "checkpoint_saved"] == ["resumed", "stopped"]
    assert events[-1]["cause"] == "timeout" and events[-1]["attempt"] == "job7.1"
    assert (RunPaths(run).checkpoints / "step_000001").is_dir()


def test_entry_point_stops_on_the_control_file_and_resumes(
    tmp_path: Path, data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = write_run(tmp_path, data, "train.steps=6")
    monkeypatch.delenv("HPCLAUNCH_ATTEMPT_CLOCK", raising=False)
    write_user_stop(RunPaths(run), continue_=False, attempt=None, by="test")
    monkeypatch.setenv("HPCLAUNCH_ATTEMPT", "first")
    assert main([str(run)]) == 0
    first = json.loads(RunPaths(run).outcome_file("first").read_text())
    assert (first["status"], first["cause"], first["step"]) == ("stopped", "user", 1)
    RunPaths(run).stop_file.unlink()
    monkeypatch.setenv("HPCLAUNCH_ATTEMPT", "second")
    assert main([str(run)]) == 0
    second = json.loads(RunPaths(run).outcome_file("second").read_text())
    assert (second["status"], second["step"], second["samples_consumed"]) == ("finished", 6, 96)
    resumed = [e for e in (e.record for e in read_events(RunPaths(run)).events) if e["event"] == "resumed"]
    assert [(e["attempt"], e["step"], e["samples_consumed"]) for e in resumed] == [
        ("first", 0, 0),
        ("second", 1, 16),
    ]
    assert resumed[1]["checkpoint"] == str(RunPaths(run).checkpoints / "step_000001")


def test_entry_point_reports_bad_data_in_one_line(
    tmp_path: Path, data: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    run = write_run(tmp_path, data, f"data.token_dir={tmp_path / 'nowhere'}")
    monkeypatch.delenv("HPCLAUNCH_ATTEMPT", raising=False)
    assert main([str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"hpclaunch: training failed: {tmp_path / 'nowhere'}: token directory does not exist"]
    out = json.loads(RunPaths(run).outcome_file("local").read_text())
    assert out["status"] == "failed" and "token directory does not exist" in out["error"]


def test_a_signal_during_set_up_stops_after_the_first_step(tmp_path: Path, data: Path) -> None:
    before = signal.getsignal(signal.SIGTERM)
    tr = trainer(tmp_path, data, "train.steps=10")
    os.kill(os.getpid(), signal.SIGTERM)  # e.g. preemption while the data was being checked
    out = tr.run()
    tr.close()
    assert (out.status, out.cause, out.step) == ("stopped", "preemption", 1)
    assert signal.getsignal(signal.SIGTERM) == before  # handlers restored
    assert "stopped" in [
        e["event"] for e in [e.record for e in read_events(RunPaths(tmp_path / "run")).events]
    ]


def test_failure_causes_decide_what_is_retried() -> None:
    from hpclaunch.errors import CheckpointError, DataError, PreflightFailed, TrainingError
    from hpclaunch.rank.ending import failure_cause
    from hpclaunch.rank.smoke import StartupHang

    missed = StartupHang("rank 1 did not reach the barrier", ranks=[1], where="rank 0", hint="")
    assert failure_cause(missed) == "hang"  # continued within max_hang_retries
    # the smoke test's all_reduce failing or returning a wrong sum is the machine's fault: retried
    assert failure_cause(PreflightFailed("distributed smoke test: all_reduce failed")) == "crash"
    assert failure_cause(RuntimeError("Connection reset by peer")) == "crash"
    # the run's own verdicts, which a retry would repeat
    assert failure_cause(DataError("token id 70000 >= vocab_size")) == "data"
    assert failure_cause(TrainingError("5 consecutive non-finite steps")) == "training"
    assert failure_cause(CheckpointError("no space left on /ckpt")) == "training"


def test_an_orderly_end_leaves_no_empty_stacks_file_and_a_dump_is_kept(
    tmp_path: Path, data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 26: every attempt left an empty rank0.stacks.txt; only a dump (a hang's evidence) stays."""
    from hpclaunch.rundir.progress_files import STACK_SIGNAL, stacks_file

    run = write_run(tmp_path, data, "train.steps=4", "watchdog.enabled=true")
    monkeypatch.setenv("HPCLAUNCH_ATTEMPT", "a1")
    assert main([str(run)]) == 0
    assert not stacks_file(RunPaths(run), "a1", 0).exists()
    # A dump during the run (as the watchdog asks for) is kept.
    from hpclaunch.trainer import loop

    original = loop.Trainer.run

    def dump_then_run(self: Any) -> Any:
        signal.raise_signal(STACK_SIGNAL)
        return original(self)

    monkeypatch.setattr(loop.Trainer, "run", dump_then_run)
    monkeypatch.setenv("HPCLAUNCH_ATTEMPT", "a2")
    run2 = RunPaths(run)
    assert main([str(run)]) == 0
    dumped = stacks_file(run2, "a2", 0)
    assert dumped.exists() and "Thread" in dumped.read_text()
