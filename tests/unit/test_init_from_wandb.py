"""``train.init_from`` and ``train.wandb`` with the real trainer in this process (one rank, real DCP,
real wandb in offline mode read back from the files it wrote)."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from tests.unit.tiny_model import tiny_model

from hpclaunch.config import RunConfig, load_config
from hpclaunch.errors import UserInputError
from hpclaunch.rank.checkpoint import load_readonly
from hpclaunch.rundir import RunPaths, read_events
from hpclaunch.rundir.control import write_user_stop
from hpclaunch.rundir.init_source import check_fits
from hpclaunch.shards import synth_dataset
from hpclaunch.trainer.entry import main
from hpclaunch.trainer.loop import Trainer
from hpclaunch.trainer.model.ema import clean_name
from hpclaunch.trainer.model.init_from import InitFromError
from hpclaunch.trainer.model.mmdit_diffusion import build_model

MODEL = tiny_model(1)
pytestmark = [pytest.mark.fast, pytest.mark.usefixtures("in_process_trainer")]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("data")
    synth_dataset(root, samples=128, seed=0, model_cfg=load_config(None, MODEL).model, shard_size=64)
    return root


def config(base: Path, data: Path, *overrides: str) -> RunConfig:
    return load_config(
        None,
        [
            *MODEL,
            "scheduler.procs_per_node=1",
            "train.global_batch=8",
            "train.steps=6",
            "train.warmup_steps=1",
            "train.log_every=1",
            "train.tensorboard=false",
            "preflight.distributed_smoke=false",
            f"data.token_dir={data / 'tokens'}",
            f"data.latent_dir={data / 'latents'}",
            *overrides,
        ],
        base=base,
    )


def train(base: Path, name: str, data: Path, *overrides: str) -> Trainer:
    cfg = config(base, data, f"run_dir={base / name}", *overrides)
    return Trainer(cfg, RunPaths(base / name).ensure(), checkpoints=True, echo=False)


@pytest.fixture(scope="module")
def stage1(tmp_path_factory: pytest.TempPathFactory, data: Path) -> Path:
    base = tmp_path_factory.mktemp("stage1")
    tr = train(base, "stage1", data, "train.ema_decay=0.5")
    assert tr.run().status == "finished"
    tr.close()
    return base / "stage1"


def ema_weights(run: Path) -> dict[str, torch.Tensor]:
    model = build_model(load_config(None, MODEL).model, seed=0)
    shadow = {clean_name(n): torch.zeros_like(p) for n, p in model.named_parameters()}
    load_readonly(RunPaths(run).checkpoints, {"model": model.state_dict(), "ema": {"weights": shadow}})
    return shadow


def test_a_new_run_starts_from_the_ema_weights_with_a_fresh_optimizer(
    tmp_path: Path, data: Path, stage1: Path
) -> None:
    tr = train(
        tmp_path,
        "stage2",
        data,
        f"train.init_from={stage1}",
        "train.init_from_ema=true",
        "train.ema_decay=0.5",
    )
    tr.resume()
    expected = ema_weights(stage1)
    for name, p in tr.model.named_parameters():
        assert torch.equal(p.detach(), expected[clean_name(name)]), name
    assert tr.ema is not None and tr.ema.updates == 0
    assert all(torch.equal(s, p.detach()) for s, p in zip(tr.ema.shadow, tr.model.parameters(), strict=True))
    assert tr.counters.step == 0 and tr.counters.samples_consumed == 0
    assert all(float(s["step"]) == 0 for s in tr.opt.state.values())  # fresh AdamW
    initialized = [
        e
        for e in [e.record for e in read_events(RunPaths(tmp_path / "stage2")).events]
        if e["event"] == "initialized"
    ]
    assert [(e["run"], e["step"], e["ema"], e["ema_from"]) for e in initialized] == [
        (str(stage1), 6, True, "model")
    ]
    tr.close()


@pytest.mark.spawns
def test_once_it_has_a_checkpoint_the_run_resumes_from_it_and_never_reinitializes(
    tmp_path: Path, data: Path, stage1: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = RunPaths(tmp_path / "stage2").ensure()
    cfg = config(tmp_path, data, f"run_dir={run.root}", f"train.init_from={stage1}")
    run.config.write_text(cfg.to_yaml())
    write_user_stop(run, continue_=False, attempt=None, by="test")
    monkeypatch.setenv("HPCLAUNCH_ATTEMPT", "first")
    assert main([str(run.root)]) == 0
    run.stop_file.unlink()
    # The source is gone: a second attempt that looked at init_from again would fail.
    (stage1.parent / "moved").mkdir()
    stage1.rename(stage1.parent / "moved" / "stage1")
    try:
        monkeypatch.setenv("HPCLAUNCH_ATTEMPT", "second")
        assert main([str(run.root)]) == 0
    finally:
        (stage1.parent / "moved" / "stage1").rename(stage1)
    events = [e.record for e in read_events(run).events]
    assert [e["attempt"] for e in events if e["event"] == "initialized"] == ["first"]
    resumed = [(e["attempt"], e["step"]) for e in events if e["event"] == "resumed"]
    assert resumed == [("first", 0), ("second", 1)]
    assert json.loads(run.outcome_file("second").read_text())["status"] == "finished"


def test_another_model_shape_is_one_line_naming_the_tensors_exit_2(
    tmp_path: Path,
    data: Path,
    stage1: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    wider = (f"train.init_from={stage1}", "model.dim_text=48")
    # Before anything is written (the CLI's check, torch-free): the settings that differ.
    with pytest.raises(UserInputError, match=r"model\.dim_text: 32 there, 48 here") as refused:
        check_fits(config(tmp_path, data, *wider))
    assert refused.value.exit_code == 2
    # In the trainer (the source changed after submission): the tensors and their shapes.
    run = RunPaths(tmp_path / "wider").ensure()
    run.config.write_text(config(tmp_path, data, f"run_dir={run.root}", *wider).to_yaml())
    monkeypatch.delenv("HPCLAUNCH_ATTEMPT", raising=False)
    assert main([str(run.root)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hpclaunch: training failed: train.init_from:"), err
    assert "model.dim_text: 32 there, 48 here" in err[0] and "[128, 32] there, [160, 32] here" in err[0]
    assert list(run.checkpoints.iterdir()) == []
    outcome = json.loads(run.outcome_file("local").read_text())
    assert outcome["status"] == "failed" and outcome["cause"] == "training"
    assert issubclass(InitFromError, Exception) and InitFromError.exit_code == 2


# ---- W&B ------------------------------------------------------------------------------------------


def wandb_records(path: Path) -> list[Any]:
    """The records of one offline ``.wandb`` file (wandb's own protobuf, in 32 KiB leveldb-log blocks)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, chunk, out = 7, 32768, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:
            break
        chunk += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST
            record = pb.Record()
            record.ParseFromString(chunk)
            out.append(record)
            chunk = b""
    return out


@pytest.mark.spawns
def test_an_offline_wandb_run_spans_both_attempts(
    tmp_path: Path, data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_API_KEY", "secret-key-never-written-0123456789abcdef")
    run = RunPaths(tmp_path / "wb").ensure()
    cfg = config(
        tmp_path, data, f"run_dir={run.root}", "train.wandb.mode=offline", "train.wandb.project=p19",
        "train.wandb.tags=[stage1]", "launch.pass_env=[WANDB_API_KEY]",
    )  # fmt: skip
    run.config.write_text(cfg.to_yaml())
    write_user_stop(run, continue_=False, attempt=None, by="test")
    monkeypatch.setenv("HPCLAUNCH_ATTEMPT", "first")
    assert main([str(run.root)]) == 0
    run.stop_file.unlink()
    monkeypatch.setenv("HPCLAUNCH_ATTEMPT", "second")
    assert main([str(run.root)]) == 0
    import wandb

    wandb.teardown()  # the service this test process started (a rank leaves with os._exit instead)

    files = sorted((run.root / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 2  # one per attempt, under one id
    run_id = json.loads((run.root / "wandb" / "hpclaunch-id.json").read_text())["id"]
    steps: list[int] = []
    marks: list[tuple[str, int]] = []
    for f in files:
        records = wandb_records(f)
        runs = [r.run for r in records if r.WhichOneof("record_type") == "run"]
        assert [(r.run_id, r.project, list(r.tags)) for r in runs] == [(run_id, "p19", ["stage1"])]
        for r in records:
            if r.WhichOneof("record_type") != "history":
                continue
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            if "loss/total" in items:
                steps.append(int(items["_step"]))
            marks += [
                (k, int(items["_step"])) for k in ("run/resumed", "run/stopped", "run/finished") if k in items
            ]
    assert steps == [1, 2, 3, 4, 5, 6]  # attempt 1 stopped after step 1; attempt 2 logged the rest
    assert marks == [("run/resumed", 1), ("run/stopped", 1), ("run/resumed", 2), ("run/finished", 6)]
    # The key reached the trainer by name only: nothing under the run directory holds it.
    for path in run.root.rglob("*"):
        if path.is_file():
            assert b"secret-key-never-written" not in path.read_bytes(), path


@pytest.mark.spawns  # wandb starts its service process
def test_wandb_online_with_an_unreachable_server_trains_on_offline_with_one_warning(
    tmp_path: Path, data: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 26: with `train.wandb.mode: online` and no way to the server, wandb.init raised and the
    attempt died as a crash. Logging never ends training: one warning, then offline into RUN/wandb/
    (kept for `wandb sync`), and the ledger says so for status."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_API_KEY", "a" * 40)
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # nothing listens: refused at once
    monkeypatch.setenv("WANDB_INIT_TIMEOUT", "5")
    run = RunPaths(tmp_path / "unreachable").ensure()
    cfg = config(tmp_path, data, f"run_dir={run.root}", "train.wandb.mode=online", "train.wandb.project=p26")
    run.config.write_text(cfg.to_yaml())
    monkeypatch.setenv("HPCLAUNCH_ATTEMPT", "only")
    assert main([str(run.root)]) == 0
    import wandb

    wandb.teardown()
    out = capsys.readouterr()
    warnings = [line for line in (out.out + out.err).splitlines() if "W&B unreachable" in line]
    assert len(warnings) == 1, out
    assert "logging offline to RUN/wandb/" in warnings[0]
    events = [e.record for e in read_events(run).events]
    (failed,) = [e for e in events if e["event"] == "experiment_log_failed"]
    assert failed["log"] == "wandb" and "CommError" in failed["error"]
    assert list((run.root / "wandb").glob("offline-run-*/run-*.wandb"))  # kept for wandb sync
    from hpclaunch.orchestrator.status import summarize

    summary = summarize(run.root).to_json()
    assert summary["step"] == 6
    assert summary["experiment_logs"] == [
        {"log": "wandb", "attempt": "only", "error": failed["error"], "action": failed["action"]}
    ]


def test_an_experiment_log_that_raises_mid_run_is_dropped_once_and_training_goes_on() -> None:
    """The class of issue 26's W&B finding: any log's failure (a write, a mark, the close) is said
    once and that log is dropped; the others keep logging."""
    from hpclaunch.trainer.reporting.explog import ExperimentLogs

    class Broken:
        def scalars(self, record: dict[str, Any]) -> None:
            raise OSError("disk quota exceeded")

        def mark(self, what: str, step: int, text: str) -> None: ...

        def close(self) -> None: ...

    class Kept:
        def __init__(self) -> None:
            self.seen: list[int] = []

        def scalars(self, record: dict[str, Any]) -> None:
            self.seen.append(record["step"])

        def mark(self, what: str, step: int, text: str) -> None: ...

        def close(self) -> None: ...

    said: list[tuple[str, str, str]] = []
    kept = Kept()
    logs = ExperimentLogs({"wandb": Broken(), "tensorboard": kept}, lambda *a: said.append(a))
    for step in (1, 2, 3):
        logs.scalars({"step": step})
    logs.close()
    assert kept.seen == [1, 2, 3] and list(logs.logs) == ["tensorboard"]
    assert [(log, error) for log, error, _ in said] == [("wandb", "OSError: disk quota exceeded")]
