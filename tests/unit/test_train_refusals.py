"""``hpclaunch train`` refuses bad trainer input in one line, exit 2, before writing anything:
validation directories missing or mismatched, a pad id outside the vocabulary, an FSDP option the
rank count cannot satisfy, a resume onto a checkpoint of another model shape."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hpclaunch.cli import main
from hpclaunch.config import RunConfig, load_config
from hpclaunch.errors import UserInputError
from hpclaunch.orchestrator.refusals import refuse_other_model_shape
from hpclaunch.rank.checkpoint import Checkpointer, RunCheckpoints
from hpclaunch.rank.checkpoint.directory import CheckpointDir
from hpclaunch.rundir import RunPaths
from hpclaunch.shards import synth_dataset

pytestmark = pytest.mark.fast


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("data")
    model = load_config(None).model
    synth_dataset(root / "train", samples=64, seed=0, model_cfg=model)
    synth_dataset(root / "val", samples=16, seed=1, model_cfg=model)
    other = load_config(None, ["model.text_len=12"]).model
    synth_dataset(root / "val-other-shape", samples=16, seed=1, model_cfg=other)
    return root


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HPCLAUNCH_DEBUG", raising=False)
    yield


def train(data: Path, *sets: str) -> list[str]:
    args = ["train", str(Path(__file__).parents[2] / "examples" / "tiny.yaml"), "--set", "name=refused"]
    args += [
        "--set",
        f"data.token_dir={data / 'train' / 'tokens'}",
        "--set",
        f"data.latent_dir={data / 'train' / 'latents'}",
    ]
    for item in sets:
        args += ["--set", item]
    return args


def save_step_40(run: RunPaths, cfg: RunConfig, *, model_hash: str) -> None:
    """A checkpoint of step 40 in ``run``, its manifest naming ``cfg``'s model and ``model_hash``."""
    checkpoints = RunCheckpoints(run.checkpoints, 1, config_hash="c", model_hash=model_hash, keep_last=2)
    ck = Checkpointer(checkpoints, rank=0)
    ck.save(
        40,
        {"model": {"w": torch.zeros(3)}},
        blocking=True,
        extra={"model": cfg.model.model_dump(mode="json")},
    )
    ck.close()


CASES = [
    (
        "validation dir missing",
        ["data.val_token_dir={data}/nope/tokens", "data.val_latent_dir={data}/nope/latents"],
        "--set: data.val_token_dir: {data}/nope/tokens does not exist",
    ),
    (
        "validation shards of another shape",
        [
            "data.val_token_dir={data}/val-other-shape/tokens",
            "data.val_latent_dir={data}/val-other-shape/latents",
        ],
        "input_ids has shape [16, 12]; the model wants [N, 32] (model.text_len=32)",
    ),
    (
        "validation token dir without its latent dir",
        ["data.val_token_dir={data}/val/tokens"],
        "data.val_latent_dir: is missing: validation needs both val_token_dir and val_latent_dir",
    ),
    (
        "eval without a validation set",
        ["train.eval_every=10"],
        "train.eval_every: needs a validation set",
    ),
    (
        "pad id outside the vocabulary",
        ["data.pad_id=256"],
        "data.pad_id: 256 is outside the vocabulary (model.vocab_size=256: ids 0..255)",
    ),
    (
        "FSDP shard size the ranks cannot satisfy",
        ["train.parallel=fsdp", "train.fsdp_shard_size=3"],
        "train.fsdp_shard_size: 3 does not divide the 2 ranks",
    ),
    (
        "FSDP option without FSDP",
        ["train.fsdp_shard_size=2"],
        "train.fsdp_shard_size: only applies to train.parallel: fsdp",
    ),
    (  # (it made /nonexistent at the filesystem root: checked below)
        "memory tier on a tmpfs that does not exist",
        ["checkpoint.memory.every_steps=5", "checkpoint.memory.dir=/nonexistent/shm"],
        "checkpoint.memory.dir: /nonexistent/shm does not exist: the memory tier's snapshots go to an "
        "existing tmpfs, which is never created",
    ),
    (
        "memory tier on a relative path",
        ["checkpoint.memory.every_steps=5", "checkpoint.memory.dir=shm"],
        "checkpoint.memory.dir: 'shm' is not an absolute path",
    ),
]


@pytest.mark.parametrize(("sets", "message"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_trainer_input_is_one_line_exit_2_and_nothing_written(
    data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], sets: list[str], message: str
) -> None:
    code = main(train(data, *(s.format(data=data) for s in sets)))
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines[0].startswith("hpclaunch: error: ") and message.format(data=data) in lines[0], err
    assert len(lines) <= 2 and "Traceback" not in err  # the error and its hint
    assert not (tmp_path / "runs").exists() and not Path("/nonexistent").exists()


def test_resume_onto_a_checkpoint_of_another_model_shape_is_refused_naming_the_settings(
    data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = load_config(None, ["name=refused", "run_dir=runs/refused"], base=tmp_path)
    run = RunPaths(tmp_path / "runs" / "refused").ensure()
    run.config.write_text(cfg.to_yaml())
    checkpoints = RunCheckpoints(
        run.checkpoints, 1, config_hash="c", model_hash=cfg.model_hash(), keep_last=2
    )
    ck = Checkpointer(checkpoints, rank=0)
    model = cfg.model.model_dump(mode="json")
    ck.save(40, {"model": {"w": torch.zeros(3)}}, blocking=True, extra={"model": model})
    ck.close()
    before = sorted(str(p.relative_to(run.root)) for p in run.root.rglob("*"))
    config_text = run.config.read_text()

    code = main([*train(data, "model.depth=3", "model.dim_text=128"), "--resume"])
    err = capsys.readouterr().err
    assert code == 2, err
    first = err.splitlines()[0]
    assert first == (
        f"hpclaunch: error: {run.checkpoints}: checkpoint step_000040 was written for another model "
        "shape (model.depth: 2 in the checkpoint, 3 now; model.dim_text: 64 in the checkpoint, 128 "
        "now); resuming would fail on every rank"
    )
    assert sorted(str(p.relative_to(run.root)) for p in run.root.rglob("*")) == before
    assert run.config.read_text() == config_text
    assert os.listdir(run.checkpoints) == ["step_000040"]


@pytest.mark.parametrize("written_by", ["this version", "a version that hashed flash_attn"])
def test_a_resume_that_toggles_flash_attn_is_accepted_on_the_login_node_and_by_the_ranks(
    tmp_path: Path, written_by: str
) -> None:
    """flash_attn changes kernels, not shapes: a checkpoint written with it off resumes with it on,
    whether its manifest holds this version's model hash or the older one that covered flash_attn."""
    cfg = load_config(None, ["name=flip", "run_dir=runs/flip"], base=tmp_path)
    flipped = load_config(None, ["name=flip", "run_dir=runs/flip", "model.flash_attn=true"], base=tmp_path)
    assert not cfg.model.flash_attn and cfg.model_hash() == flipped.model_hash()
    older = hashlib.sha256(
        json.dumps(cfg.model.model_dump(mode="json"), sort_keys=True).encode()
    ).hexdigest()[:16]
    written = cfg.model_hash() if written_by == "this version" else older
    assert written in flipped.model_hashes_accepted()
    run = RunPaths(tmp_path / "runs" / "flip").ensure()
    save_step_40(run, cfg, model_hash=written)

    refuse_other_model_shape(flipped, run.root)  # the login node's check: no refusal
    ranks = RunCheckpoints(
        run.checkpoints,
        1,
        config_hash="c",
        model_hash=flipped.model_hash(),
        keep_last=2,
        model_hashes_before=flipped.model_hashes_accepted()[1:],
    )
    choice = CheckpointDir(ranks, ledger=None).choose()  # rank 0's choice: no CheckpointError
    assert choice.error is None and choice.info is not None and choice.info.step == 40, choice
    before_fix = RunCheckpoints(
        run.checkpoints, 1, config_hash="c", model_hash=flipped.model_hash(), keep_last=2
    )
    refused = CheckpointDir(before_fix, ledger=None).choose()  # without the older hashes accepted
    assert (refused.error is not None) == (written_by != "this version"), refused
    other_shape = load_config(None, ["model.depth=3", "model.flash_attn=true"], base=tmp_path)
    with pytest.raises(
        UserInputError, match=r"another model shape \(model.depth: 2 in the checkpoint, 3 now\)"
    ):
        refuse_other_model_shape(other_shape.model_copy(update={"run_dir": str(run.root)}), run.root)


def test_train_resume_of_a_run_that_trained_all_its_steps_is_refused_as_submit_refuses_it(
    data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No attempt is added to a finished run (it was: an empty attempt 200->200, exit 0), and the run
    is the directory named, where it is now (moved, it resumed at its old place, from scratch)."""
    cfg = load_config(
        None, ["name=done", "run_dir=runs/done", "train.steps=40", "train.warmup_steps=2"], base=tmp_path
    )
    run = RunPaths(tmp_path / "runs" / "done").ensure()
    run.config.write_text(cfg.to_yaml())
    save_step_40(run, cfg, model_hash=cfg.model_hash())
    run = RunPaths(run.root.rename(tmp_path / "moved"))  # moved: its config.yaml still says runs/done
    before = sorted(str(p.relative_to(run.root)) for p in run.root.rglob("*"))
    assert main(["train", str(run.root), "--resume"]) == 2
    first = capsys.readouterr().err.splitlines()
    assert (
        first[0]
        == f"hpclaunch: error: --resume: {run.root} has finished (step 40/40): there is nothing to resume"
    )
    assert (
        first[1].strip()
        == f"hint: to train it longer: hpclaunch train {run.root} --resume --set train.steps=N (N > 40)"
    )
    assert sorted(str(p.relative_to(run.root)) for p in run.root.rglob("*")) == before
    assert not (tmp_path / "runs" / "done").exists()
    assert main(["train", str(run.root), "--resume", "--set", "run_dir=elsewhere"]) == 2
    assert "run_dir cannot be set with it" in capsys.readouterr().err


def test_sample_refuses_a_missing_step_and_an_unknown_mode_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = load_config(None, ["name=s", "run_dir=runs/s"], base=tmp_path)
    run = RunPaths(tmp_path / "runs" / "s").ensure()
    run.config.write_text(cfg.to_yaml())
    ck = Checkpointer(
        RunCheckpoints(run.checkpoints, 1, config_hash="c", model_hash="m", keep_last=2), rank=0
    )
    ck.save(40, {"model": {"w": torch.zeros(3)}}, blocking=True)
    ck.close()
    assert main(["sample", str(run.root), "--mode", "l2t", "--step", "7"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == f"hpclaunch: error: {run.checkpoints}: no checkpoint of step 7 (published steps: 40)"
    assert main(["sample", str(run.root), "--mode", "text"]) == 2
    assert "--mode 'text' is not one of t2l, l2t, joint" in capsys.readouterr().err
    assert not (run.root / "samples").exists()
