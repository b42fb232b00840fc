"""EMA and validation in one process (FSDP2 on a one-rank gloo group of its own, as a single-process
``train.parallel: fsdp`` run uses): the average's arithmetic, evaluation that is fixed and leaves
training untouched, and sampling that unmasks every position."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tests.unit.tiny_model import tiny_model

from hpclaunch.config import RunConfig, load_config
from hpclaunch.fsutil import read_jsonl
from hpclaunch.rundir import RunPaths
from hpclaunch.shards import synth_dataset
from hpclaunch.trainer.loop import Trainer
from hpclaunch.trainer.model.ema import EMA
from hpclaunch.trainer.model.mmdit_diffusion import build_model
from hpclaunch.trainer.sample import generate
from hpclaunch.trainer.state import params_sha256

MODEL = tiny_model(2)

pytestmark = [pytest.mark.fast, pytest.mark.usefixtures("in_process_trainer")]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("data")
    synth_dataset(root, samples=160, seed=0, model_cfg=load_config(None, MODEL).model, shard_size=64)
    return root


def config(tmp_path: Path, data: Path, *overrides: str) -> RunConfig:
    return load_config(
        None,
        [
            *MODEL, "scheduler.procs_per_node=1", "train.steps=6", "train.global_batch=8",
            "train.lr=3e-3", "train.warmup_steps=1", "train.log_every=1", "data.num_workers=0",
            "preflight.distributed_smoke=false", f"data.token_dir={data / 'tokens'}",
            f"data.latent_dir={data / 'latents'}", *overrides,
        ],
        base=tmp_path,
    )  # fmt: skip


def test_ema_follows_the_warmed_up_decay_and_swaps_in_and_out_exactly() -> None:
    model = build_model(load_config(None, MODEL).model, seed=0)
    ema = EMA(model, decay=0.99)
    p = next(model.parameters())
    start = p.detach().clone()
    with torch.no_grad():
        p.add_(1.0)
    ema.update()  # first update: decay min(0.99, 1/10) = 0.1
    assert torch.allclose(ema.shadow[0], 0.1 * start + 0.9 * (start + 1.0))
    assert ema.updates == 1 and ema.current_decay() == pytest.approx(2 / 11)
    training = params_sha256(model)
    with ema.applied():
        assert torch.equal(p, ema.shadow[0])
    assert params_sha256(model) == training  # the training weights come back bit for bit
    assert set(ema.state_dict()["weights"]) == {n for n, _ in model.named_parameters()}


@pytest.mark.spawns
def test_fsdp_evaluation_is_fixed_and_leaves_training_bitwise_untouched(tmp_path: Path, data: Path) -> None:
    common = ["train.parallel=fsdp", "train.ema_decay=0.9", "data.val_fraction=0.2", "train.eval_samples=12"]
    results = {}
    for name, extra in (("with-eval", ["train.eval_every=2"]), ("without", [])):
        cfg = config(tmp_path, data, *common, *extra)
        tr = Trainer(cfg, RunPaths(tmp_path / name).ensure(), checkpoints=False, echo=False)
        try:
            out = tr.run()
            evals = (tr.evaluate(), tr.evaluate()) if tr.evaluator is not None else None
        finally:
            tr.close()
        results[name] = (out.extra["ranks"][0]["state_sha256"], evals)
    (state_a, evals), (state_b, _) = results["with-eval"], results["without"]
    assert state_a == state_b  # evaluating (EMA weights swapped in and out) changed no weight or moment
    assert evals is not None and evals[0] == evals[1]  # the same fixed set, the same numbers
    assert evals[0]["val_loss"] is not None and evals[0]["val_text_loss"] > 0
    lines = read_jsonl(RunPaths(tmp_path / "with-eval").metrics)
    assert [line["step"] for line in lines if line["val_loss"] is not None] == [2, 4, 6]
    assert lines[-1]["val_loss"] == evals[0]["val_loss"]  # step 6's evaluation, repeated after the run


def test_generation_fills_every_real_position_and_keeps_padding(tmp_path: Path, data: Path) -> None:
    model = build_model(load_config(None, MODEL).model, seed=0).eval()
    tokens = torch.randint(0, 64, (3, 16))
    mask = torch.ones(3, 16, dtype=torch.bool)
    mask[0, 10:] = False
    latents = torch.randn(3, 4, 8)
    ids, x = generate(model, "joint", tokens=tokens, latents=latents, mask=mask, steps=4, seed=0)
    assert not (ids == model.mask_id).any() and torch.equal(ids[0, 10:], tokens[0, 10:])
    assert x.shape == latents.shape and not torch.equal(x, latents)
    ids_l2t, x_l2t = generate(model, "l2t", tokens=tokens, latents=latents, mask=mask, steps=4, seed=0)
    assert torch.equal(x_l2t, latents) and not (ids_l2t == model.mask_id).any()
    again, _ = generate(model, "l2t", tokens=tokens, latents=latents, mask=mask, steps=4, seed=0)
    assert torch.equal(again, ids_l2t)
