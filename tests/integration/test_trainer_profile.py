"""``train.profile``: the profiled steps' summary and tables land in RUN/profile, the run itself is
unchanged (same losses as without), and a run that ends inside the profiled steps still writes it."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from hpclaunch.config import load_config
from hpclaunch.fsutil import read_jsonl
from hpclaunch.rundir import RunPaths
from hpclaunch.shards import synth_dataset
from hpclaunch.trainer.loop import Trainer

sys.path.insert(0, str(Path(__file__).parent / "helpers"))
import trainer_helpers as h

SMALL = h.ONE_BLOCK


@pytest.fixture(autouse=True)
def _single_process(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    yield


def train(tmp_path: Path, name: str, *extra: str) -> Path:
    cfg = load_config(
        None,
        [
            *SMALL, "scheduler.procs_per_node=1", "train.steps=6", "train.warmup_steps=1", "train.global_batch=4",
            "train.log_every=1", "data.num_workers=0", "preflight.distributed_smoke=false",
            f"data.token_dir={tmp_path / 'd' / 'tokens'}", f"data.latent_dir={tmp_path / 'd' / 'latents'}", *extra,
        ],
        base=tmp_path,
    )  # fmt: skip
    trainer = Trainer(cfg, RunPaths(tmp_path / name).ensure(), checkpoints=False, echo=False)
    try:
        assert trainer.run().status == "finished"
    finally:
        trainer.close()
    return tmp_path / name


def test_profiled_steps_are_summarised_and_the_run_is_the_same(tmp_path: Path) -> None:
    synth_dataset(tmp_path / "d", samples=64, seed=0, model_cfg=load_config(None, SMALL).model)
    plain = train(tmp_path, "plain")
    profiled = train(tmp_path, "profiled", "train.profile.start=3", "train.profile.steps=2")
    summary = json.loads((profiled / "profile" / "rank0.json").read_text())
    assert summary["steps"] == 2 and summary["rank"] == 0
    assert summary["step_ms"] > 0 and summary["aten_ops"] > 100
    assert summary["gpu_busy_fraction"] is None and summary["kernels"] == 0  # the CPU: no device activity
    assert summary["top_host_ops"] and all(op["self_ms"] >= 0 for op in summary["top_host_ops"])
    assert "Self CPU" in (profiled / "profile" / "rank0.txt").read_text()
    assert not (plain / "profile").exists()
    losses = [[line["loss"] for line in read_jsonl(RunPaths(run).metrics)] for run in (plain, profiled)]
    assert losses[0] == losses[1]


def test_a_profile_that_outlasts_the_run_is_written_with_the_steps_it_has(tmp_path: Path) -> None:
    synth_dataset(tmp_path / "d", samples=64, seed=0, model_cfg=load_config(None, SMALL).model)
    run = train(
        tmp_path, "short", "train.profile.start=5", "train.profile.steps=10", "train.profile.trace=true"
    )
    summary = json.loads((run / "profile" / "rank0.json").read_text())
    assert summary["steps"] == 2  # steps 5 and 6 of 6
    assert (run / "profile" / "rank0.trace.json.gz").stat().st_size > 0
