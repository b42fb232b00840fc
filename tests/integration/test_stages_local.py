"""Multi-stage runs on the local scheduler, through the real CLI (torchrun, gloo, FSDP2, DCP).

Stage 1 trains FSDP on 2 ranks with an EMA, in 40 s attempts it outgrows (45 s of slept steps alone) (stopped at the limit and
requeued at least once), logging to W&B offline. Stage 2 (DDP, 1 rank) is submitted right after it
with ``--after`` and ``init_from`` stage 1's EMA: it must start only after stage 1 has finished,
and its first loss must be the loss of stage 1's final EMA model on stage 2's first batch. A stage 1
that fails keeps its stage 2 from running; a stage 2 of another model shape is refused at once.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from tests.runlib import TINY, events, hpclaunch, status, synth_data, tiny_overrides, wait_for, wait_run_done

pytestmark = pytest.mark.slow

STAGE1 = (
    "train.parallel=fsdp",
    "train.ema_decay=0.9",
    "train.steps=150",  # (its steps' compute, FSDP on two busy cores, is most of the module's time)
    "testing.step_sleep_s=0.3",
    "testing.step_sleep_resumed=false",  # stopped in its first attempt; the next one ends soon
    "train.log_every=10",
    "checkpoint.every_steps=50",
    "scheduler.time_limit=40s",
    "launch.stop_margin_s=2",
    "train.wandb.mode=offline",
    "train.wandb.project=stages",
)
STAGE2 = (
    "scheduler.procs_per_node=1",
    "train.parallel=ddp",
    "train.ema_decay=0.9",
    "train.steps=10",
    "train.warmup_steps=2",
    "train.log_every=1",
    "train.init_from_ema=true",
)


@pytest.fixture(scope="module")
def stages(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("stages")
    data = synth_data(work / "data")
    runs = work / "runs"

    def submit(name: str, *extra: str, after: str | None = None) -> str:
        args = ["submit", str(TINY), *tiny_overrides(work, data, name, *extra), "--no-preflight"]
        return hpclaunch(*args, *(["--after", str(runs / after)] if after else []), cwd=work).stdout

    submit("stage1", *STAGE1)
    submit(
        "bad1",
        "train.steps=100",
        "testing.step_sleep_s=0.1",
        "testing.inject_nonfinite_at=[50]",
        "train.max_nonfinite_skips=1",
    )
    out = submit("stage2", *STAGE2, f"train.init_from={runs / 'stage1'}", after="stage1")
    assert "held until it finishes" in out
    submit("bad2", "train.steps=10", "train.warmup_steps=2", after="bad1")
    return {"work": work, "data": data, "runs": runs}


def first(run: Path, name: str) -> dict[str, Any]:
    return next(e for e in events(run) if e["event"] == name)


@pytest.mark.timeout(1200)
def test_stage2_starts_after_stage1_finishes_from_its_ema(stages: dict[str, Any]) -> None:
    work, runs = stages["work"], stages["runs"]
    s1 = wait_run_done(runs / "stage1", work, timeout=900)
    assert s1["state"] == "finished", json.dumps(s1, indent=1)[-3000:]
    ends = [(a["end"], a["cause"]) for a in s1["attempts"]]
    assert len(ends) >= 2 and ends[0] == ("requeued", "timeout"), ends
    s2 = wait_run_done(runs / "stage2", work, timeout=200)
    assert s2["state"] == "finished", json.dumps(s2, indent=1)[-3000:]
    assert first(runs / "stage2", "started")["ts"] >= first(runs / "stage1", "finished")["ts"]
    assert s2["weights_from"] == {
        "checkpoint": str(runs / "stage1" / "checkpoints" / "step_000150"),
        "run": str(runs / "stage1"),
        "step": 150,
        "ema": True,
        "source_world_size": 2,
        "source_parallel": "fsdp",
    }
    assert s2["chain"]["after"]["outcome"] == "released" and s1["chain"]["next"][0]["outcome"] == "released"
    assert s2["attempts"][0]["resumed_step"] == 0 and s2["attempts"][0]["world_size"] == 1
    # words, not lines: the table wraps at the terminal width, and the paths in it vary in length
    shown = " ".join(hpclaunch("status", str(runs / "stage2"), cwd=work).stdout.split())
    assert "started from the EMA weights of" in shown and "released" in shown
    # status --json of stage 1: what it cost (CPU: node-hours) and an ETA of 0 now that it is done
    assert s1["cost"]["state"] == "finished" and s1["cost"]["unit"] == "node-hours"
    assert s1["cost"]["node_hours_spent"] > 0


def test_stage2_first_loss_is_stage1_ema_models_loss_on_that_batch(stages: dict[str, Any]) -> None:
    runs = stages["runs"]
    wait_run_done(runs / "stage2", stages["work"], timeout=600)
    lines = [json.loads(x) for x in (runs / "stage2" / "metrics.jsonl").read_text().splitlines()]
    logged = next(x for x in lines if x["step"] == 1)["loss"]
    assert logged == pytest.approx(ema_loss_on_first_batch(runs), rel=1e-5, abs=1e-6)


def ema_loss_on_first_batch(runs: Path) -> float:
    """Stage 1's final EMA weights (read from its checkpoint) on stage 2's first step's batch."""
    from hpclaunch.rank.checkpoint import load_readonly
    from hpclaunch.rundir import RunPaths, read_config
    from hpclaunch.shards import validate_dataset
    from hpclaunch.trainer.data.dataset import SampleOrder, ShardedDataset
    from hpclaunch.trainer.data.loader import StepBatches, StepPlan, micro_batches
    from hpclaunch.trainer.model.ema import clean_name
    from hpclaunch.trainer.model.mmdit_diffusion import build_model
    from hpclaunch.trainer.model.objective import Objective, compute_losses

    cfg = read_config(RunPaths(runs / "stage2"))
    t, m = cfg.train, cfg.model
    model = build_model(m, seed=t.seed)
    shadow = {clean_name(n): torch.zeros_like(p) for n, p in model.named_parameters()}
    load_readonly(
        RunPaths(runs / "stage1").checkpoints, {"model": model.state_dict(), "ema": {"weights": shadow}}
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(shadow[clean_name(name)])
    info = validate_dataset(cfg.data.token_dir, cfg.data.latent_dir, m, max_shards=0)
    plan = StepPlan(
        seed=t.seed, first_step=1, first_position=0, steps=1, global_batch=t.global_batch, rank=0,
        per_rank=cfg.per_rank_batch, micro=cfg.micro_batch, pad_id=cfg.data.pad_id,
    )  # fmt: skip
    item = StepBatches(ShardedDataset(info, m), SampleOrder(info.num_samples, t.seed, None), plan)[0]
    with torch.no_grad():
        losses = [
            compute_losses(
                model, mb.tokens, mb.latents, mb.draws, Objective.of(cfg), text_mask=mb.text_mask
            ).total.item()
            for mb in micro_batches(item, torch.device("cpu"))
        ]  # fmt: skip
    return sum(losses) / len(losses)


def test_a_failed_stage1_keeps_stage2_from_running(stages: dict[str, Any]) -> None:
    work, runs = stages["work"], stages["runs"]
    s1 = wait_run_done(runs / "bad1", work, timeout=300)
    assert s1["state"] == "failed", json.dumps(s1, indent=1)[-3000:]
    s2 = wait_for(
        lambda: (s := status(runs / "bad2", work))["state"] == "cancelled" and s, timeout=60, what="bad2"
    )
    assert s2["chain"]["after"]["outcome"] == "cancelled" and "non-finite" in s2["chain"]["after"]["reason"]
    assert not any(e["event"] == "started" for e in events(runs / "bad2"))
    assert "never runs" in " ".join(hpclaunch("status", str(runs / "bad2"), cwd=work).stdout.split())


def test_stage1_logged_one_wandb_run_across_its_attempts(stages: dict[str, Any]) -> None:
    from tests.unit.test_init_from_wandb import wandb_records

    run = stages["runs"] / "stage1"
    wait_run_done(run, stages["work"], timeout=400)
    attempts = len([e for e in events(run) if e["event"] == "resumed"])
    files = sorted((run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert attempts >= 2 and len(files) == attempts
    ids, steps = set(), []
    for f in files:
        for r in wandb_records(f):
            if r.WhichOneof("record_type") == "run":
                ids.add(r.run.run_id)
            elif r.WhichOneof("record_type") == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
                if "loss/total" in items:
                    steps.append(int(items["_step"]))
    assert len(ids) == 1 and steps == sorted(set(steps)) and steps[-1] == 150


def test_another_model_shape_is_refused_before_anything_is_written(stages: dict[str, Any]) -> None:
    work, runs = stages["work"], stages["runs"]
    wait_run_done(runs / "stage1", work, timeout=400)
    args = tiny_overrides(
        work, stages["data"], "wider", f"train.init_from={runs / 'stage1'}", "model.dim_text=96"
    )
    out = hpclaunch("train", str(TINY), *args, cwd=work, check=False)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "holds another model shape (model.dim_text: 64 there, 96 here)" in out.stderr.splitlines()[0]
    assert not (runs / "wider").exists()
