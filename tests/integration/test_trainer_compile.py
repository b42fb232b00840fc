"""``train.compile`` with activation checkpointing under FSDP2 on two ranks, on the CPU (inductor
compiles each MMDiT block): it trains, and its losses are those of the eager run up to rounding.
(Two ranks: one rank trains the model unwrapped, tests/unit/test_fsdp_bf16_on_cpu.py.)"""

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
    data = tmp_path / "d"
    synth_dataset(data, samples=64, seed=0, model_cfg=load_config(None, MODEL).model)
    losses = {}
    for name, extra in (
        ("eager", []),
        ("compiled", ["train.compile=true", "train.activation_checkpointing=true"]),
    ):
        run = tmp_path / name
        cfg = load_config(
            None,
            [
                *MODEL, "scheduler.procs_per_node=2", "train.steps=4", "train.warmup_steps=1",
                "train.global_batch=8", "train.log_every=1", "train.parallel=fsdp", "data.num_workers=0",
                "preflight.distributed_smoke=false", f"data.token_dir={data / 'tokens'}",
                f"data.latent_dir={data / 'latents'}", f"run_dir={run}", *extra,
            ],
            base=tmp_path,
        )  # fmt: skip
        RunPaths(run).ensure()
        (run / "config.yaml").write_text(cfg.to_yaml())
        proc = h.train(run, nproc=2, timeout=900)  # (two ranks compile side by side on a busy machine)
        assert proc.returncode == 0, h.describe(proc)
        assert h.outcome(run)["status"] == "finished"
        losses[name] = [line["loss"] for line in read_jsonl(RunPaths(run).metrics)]
    # the caches it made, for an attempt on a node that has none (trainer.compile_cache)
    (artifact,) = (tmp_path / "compiled" / "compile_cache").glob("torch-*-cpu.bin")
    assert artifact.stat().st_size > 0
    assert len(losses["compiled"]) == 4
    assert losses["compiled"] == pytest.approx(losses["eager"], rel=1e-4)
