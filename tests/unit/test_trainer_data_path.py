"""The data path: memory-mapped shards, step items prepared by DataLoader workers at exact sample
positions, the validation hold-out, the once-per-dataset token check, variable-length text."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from hpclaunch.cli import main
from hpclaunch.config import load_config
from hpclaunch.rank.helper_signals import STOP_SIGNALS
from hpclaunch.shards import checked as record
from hpclaunch.shards import synth_dataset, validate_dataset
from hpclaunch.trainer.data.dataset import SampleOrder, ShardedDataset, holdout_split
from hpclaunch.trainer.data.loader import StepBatches, StepPlan, make_loader
from hpclaunch.trainer.model.mmdit_diffusion import build_model
from hpclaunch.trainer.model.objective import Objective, compute_losses, draw

M = load_config(
    None, ["model.text_len=12", "model.latent_len=3", "model.latent_dim=4", "model.vocab_size=50"]
).model


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("data")
    synth_dataset(root, samples=100, seed=0, model_cfg=M, shard_size=30, pad_id=0)
    return root


def dataset(data: Path) -> ShardedDataset:
    return ShardedDataset(validate_dataset(data / "tokens", data / "latents", M), M)


def plan(first_step: int = 1, **kw: int) -> StepPlan:
    args = {"seed": 3, "first_step": first_step, "first_position": (first_step - 1) * 12, "steps": 6}
    args |= {"global_batch": 12, "rank": 1, "per_rank": 6, "micro": 3, "pad_id": 0, **kw}
    return StepPlan(**args)  # type: ignore[arg-type]


def test_shards_are_memory_mapped_not_loaded(data: Path) -> None:
    ds = dataset(data)
    assert all(isinstance(a, np.memmap) for a in ds._tokens + ds._latents)
    ids, lat = ds.get(np.array([99, 0, 31, 30, 5]))
    whole = np.concatenate([np.load(p)["input_ids"] for p in sorted((data / "tokens").glob("*.npz"))])
    assert np.array_equal(ids, whole[[99, 0, 31, 30, 5]]) and lat.dtype == np.float32


def test_step_items_are_exact_positions_and_workers_prepare_the_same_bytes(data: Path) -> None:
    ds, order = dataset(data), SampleOrder(100, 3)
    direct = StepBatches(ds, order, plan())
    item = direct[2]  # step 3, rank 1: positions 24 + 6 .. 24 + 11, in 2 micro-batches of 3
    assert int(item["step"]) == 3 and item["tokens"].shape == (2, 3, 12)
    ids, _ = ds.get(order.indices(24 + 6, 6))
    assert torch.equal(item["tokens"].reshape(6, 12), torch.from_numpy(ids))
    d = draw(3, 3, [33, 34, 35], 12, (3, 4))
    assert torch.equal(item["noise"][1], d.noise) and torch.equal(item["t_text"][1], d.t_text)
    assert torch.equal(item["text_mask"], item["tokens"] != 0)
    loader = make_loader(direct, num_workers=2, prefetch_factor=2, pin_memory=False)
    for i, got in enumerate(loader):
        assert all(torch.equal(got[k], direct[i][k]) for k in direct[i]), i
    # A loader that starts at step 4 (a resume) yields what the first one yielded for step 4 on.
    resumed = StepBatches(ds, order, plan(first_step=4, steps=3))
    assert all(torch.equal(resumed[0][k], direct[3][k]) for k in resumed[0])


def test_a_stop_signal_sent_to_the_whole_job_leaves_the_loader_workers_running(data: Path) -> None:
    """SLURM signals every process of the step: the workers must outlive a SIGTERM or SIGUSR1
    (before this, the rank died of "DataLoader worker is killed by signal" in its stop save)."""
    import psutil

    ds, order = dataset(data), SampleOrder(100, 3)
    direct = StepBatches(ds, order, plan())
    loader = make_loader(direct, num_workers=1, prefetch_factor=1, pin_memory=False)
    first = next(loader)
    workers = psutil.Process().children(recursive=False)
    assert workers, "the loader started no worker process"
    for w in workers:
        for sig in STOP_SIGNALS:  # the helpers' one policy (the writer's test sends them too)
            os.kill(w.pid, sig)
    time.sleep(0.5)
    rest = list(loader)
    got = [first, *rest]
    assert len(got) == len(direct)
    assert all(torch.equal(got[i][k], direct[i][k]) for i in range(len(direct)) for k in direct[i])


def test_holdout_is_fixed_by_the_seed_and_never_trained_on() -> None:
    train, val = holdout_split(200, 0.1, seed=5)
    again_train, again_val = holdout_split(200, 0.1, seed=5)
    assert np.array_equal(val, again_val) and np.array_equal(train, again_train) and len(val) == 20
    assert not set(val.tolist()) & set(train.tolist()) and len(train) + len(val) == 200
    order = SampleOrder(200, 5, train)
    seen = order.indices(0, 360)  # two epochs of the 180 training samples
    assert set(seen.tolist()) == set(train.tolist()) and not set(seen.tolist()) & set(val.tolist())
    assert not np.array_equal(holdout_split(200, 0.1, seed=6)[1], val)


def test_the_token_range_check_runs_once_per_dataset(tmp_path: Path) -> None:
    synth_dataset(tmp_path / "d", samples=40, seed=0, model_cfg=M, shard_size=10)
    tokens, latents = tmp_path / "d" / "tokens", tmp_path / "d" / "latents"
    first = validate_dataset(tokens, latents, M, known_good=record.known_good(tokens, M.vocab_size))
    assert first.fully_checked == 4
    assert record.record(first, tokens, M.vocab_size) == tokens / record.DATA_RECORD_NAME
    second = validate_dataset(tokens, latents, M, known_good=record.known_good(tokens, M.vocab_size))
    assert (second.fully_checked, second.known_good) == (0, 4)  # nothing read again
    assert len(record.known_good(tokens, M.vocab_size + 10)) == 4  # a larger vocabulary: still fine
    assert record.known_good(tokens, M.vocab_size - 10) == set()  # a smaller one: check again
    shard = sorted(tokens.glob("*.npz"))[1]
    os.utime(shard, ns=(time.time_ns(), time.time_ns() + 10**9))  # rewritten (new mtime)
    assert str(shard) not in record.known_good(tokens, M.vocab_size)
    third = validate_dataset(tokens, latents, M, known_good=record.known_good(tokens, M.vocab_size))
    assert (third.fully_checked, third.known_good) == (1, 3)


def test_read_only_data_keeps_its_record_in_the_run_directory(tmp_path: Path) -> None:
    synth_dataset(tmp_path / "d", samples=10, seed=0, model_cfg=M)
    tokens, run = tmp_path / "d" / "tokens", tmp_path / "run"
    run.mkdir()
    info = validate_dataset(tokens, tmp_path / "d" / "latents", M)
    (tokens / record.DATA_RECORD_NAME).mkdir()  # the data directory's place is taken
    assert record.record(info, tokens, M.vocab_size, run) == run / record.RUN_RECORD_NAME
    assert len(record.known_good(tokens, M.vocab_size, run)) == 1


def test_synthetic_variable_length_text_pads_the_tail_and_never_uses_the_pad_id_inside(data: Path) -> None:
    ids, _ = dataset(data).get(np.arange(100))
    real = ids != 0
    lengths = real.sum(axis=1)
    assert lengths.min() >= 3 and lengths.max() == 12 and len(set(lengths.tolist())) > 5
    assert all(row[:n].all() and not row[n:].any() for row, n in zip(real, lengths, strict=True))


def test_padding_is_never_masked_scored_or_attended_to(data: Path) -> None:
    ids, lat = dataset(data).get(np.arange(8))
    tokens, latents = torch.from_numpy(ids), torch.from_numpy(lat)
    mask = tokens != 0
    model = build_model(M, seed=0)
    d = draw(0, 1, list(range(8)), 12, (3, 4))
    objective = Objective("joint", M.vocab_size, 1.0, 1.0)
    base = compute_losses(model, tokens, latents, d, objective, text_mask=mask)
    assert base.text_count is not None and base.text_count <= mask.sum()
    other = torch.where(mask, tokens, torch.full_like(tokens, 7))  # different ids behind the padding
    again = compute_losses(model, other, latents, d, objective, text_mask=mask)
    assert torch.equal(base.total, again.total)  # padding takes no part: not attended, not scored
    unmasked = compute_losses(model, other, latents, d, objective)
    assert not torch.equal(base.total, unmasked.total)


def test_data_synth_pad_id_option(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["data", "synth", str(tmp_path / "d"), "--samples", "20", "--pad-id", "3"]) == 0
    assert "text padded with id 3 (set data.pad_id: 3)" in capsys.readouterr().out
    assert main(["data", "synth", str(tmp_path / "e"), "--samples", "20", "--pad-id", "256"]) == 2
    assert "--pad-id 256 is outside the vocabulary" in capsys.readouterr().err


def test_a_stop_signal_in_a_workers_start_up_leaves_it_running(
    data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A preemption landing as the first step starts: the signal reaches a worker after torch's own
    SIGTERM handler is in place and before ``_worker_init`` ignores it (here: sent by the worker to
    itself at that point). It must stay pending and be dropped, not end the worker (before this,
    the rank failed as a crash: "DataLoader worker ... exited unexpectedly")."""
    from hpclaunch.trainer.data import loader as loader_module

    real_init = loader_module._worker_init

    def signalled_init(worker_id: int) -> None:
        for sig in STOP_SIGNALS:
            os.kill(os.getpid(), sig)
        real_init(worker_id)

    monkeypatch.setattr(loader_module, "_worker_init", signalled_init)
    ds, order = dataset(data), SampleOrder(100, 3)
    direct = StepBatches(ds, order, plan())
    got = list(make_loader(direct, num_workers=2, prefetch_factor=1, pin_memory=False))
    assert len(got) == len(direct)
    assert all(torch.equal(got[i][k], direct[i][k]) for i in range(len(direct)) for k in direct[i])
