"""``train.compile`` with activation checkpointing under FSDP2, on the CPU (inductor compiles each
MMDiT block): it trains, and its losses are those of the eager run up to rounding."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hpclaunch.config import load_config
from hpclaunch.fsutil import read_jsonl
from hpclaunch.rundir import RunPaths
from hpclaunch.shards import synth_dataset
from hpclaunch.trainer.loop import Trainer

sys.path.insert(0, str(Path(__file__).parent / "helpers"))
import trainer_helpers as h

pytestmark = pytest.mark.slow  # inductor's first compile of a block takes most of a minute on CPU

MODEL = h.ONE_BLOCK


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    yield
    torch.use_deterministic_algorithms(False)


def test_compiled_checkpointed_fsdp_blocks_train_like_eager_ones(tmp_path: Path) -> None:
    synth_dataset(tmp_path / "d", samples=64, seed=0, model_cfg=load_config(None, MODEL).model)
    losses = {}
    for name, extra in (
        ("eager", []),
        ("compiled", ["train.compile=true", "train.activation_checkpointing=true"]),
    ):
        cfg = load_config(
            None,
            [
                *MODEL, "scheduler.procs_per_node=1", "train.steps=4", "train.warmup_steps=1",
                "train.global_batch=8", "train.log_every=1", "train.parallel=fsdp", "data.num_workers=0",
                "preflight.distributed_smoke=false", f"data.token_dir={tmp_path / 'd' / 'tokens'}",
                f"data.latent_dir={tmp_path / 'd' / 'latents'}", *extra,
            ],
            base=tmp_path,
        )  # fmt: skip
        trainer = Trainer(cfg, RunPaths(tmp_path / name).ensure(), checkpoints=False, echo=False)
        try:
            assert trainer.run().status == "finished"
            if name == "compiled":  # each block is compiled and wrapped for recomputation
                assert all(hasattr(b, "_checkpoint_wrapped_module") for b in trainer.model.trunk.blocks)
                assert all(b._compiled_call_impl is not None for b in trainer.model.trunk.blocks)
                # the caches it made, for an attempt on a node that has none (trainer.compile_cache)
                (artifact,) = (tmp_path / name / "compile_cache").glob("torch-*-cpu.bin")
                assert artifact.stat().st_size > 0
        finally:
            trainer.close()
        losses[name] = [line["loss"] for line in read_jsonl(RunPaths(tmp_path / name).metrics)]
    assert losses["compiled"] == pytest.approx(losses["eager"], rel=1e-4)
