"""Preflight's memory estimate per GPU: the 2 x 8 H100 example fits under FSDP with activation
checkpointing and fails the ``config`` check when it would not fit; the budget comes from the
config or from the GPUs the probe sees."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hpclaunch.config import load_config
from hpclaunch.preflight.check_context import CheckContext
from hpclaunch.preflight.layout import check_config
from hpclaunch.preflight.probe import StaticProbe
from hpclaunch.preflight.sizes import estimate_memory, estimate_parameters

EXAMPLE = Path(__file__).parents[2] / "examples" / "fsdp-2x8xh100.yaml"
NOT_FITTING = ["train.parallel=ddp", "train.fsdp_shard_size=null", "train.activation_checkpointing=false"]


def outcome(sets: list[str], probe: dict[str, Any] | None = None) -> Any:
    cfg = load_config(EXAMPLE, sets)
    answer = {"torch": {"devices": []}} if probe is None else probe
    return check_config(CheckContext(cfg=cfg, node=None, probe=StaticProbe(answer)))


def test_the_example_fits_80_gb_and_says_how_much_of_what() -> None:
    out = outcome([])
    assert out.status.value == "pass", out
    (memory,) = [part for part in out.finding.split("; ") if part.startswith("memory per GPU")]
    assert "fits 74.5 GiB (train.memory_budget_gb)" in memory  # 80 GB
    for part in ("parameters", "gradients", "optimizer", "ema", "fsdp gathered", "activations"):
        assert part in memory
    assert "[fsdp, activation checkpointing, micro-batch 16" in memory


def test_without_sharding_and_checkpointing_it_does_not_fit_and_preflight_fails_with_what_to_change() -> None:
    out = outcome(NOT_FITTING)
    assert out.status.value == "fail"
    assert "does not fit 74.5 GiB (train.memory_budget_gb)" in out.finding
    assert out.hint is not None
    assert "train.parallel: fsdp" in out.hint and "train.activation_checkpointing: true" in out.hint


def test_sharding_divides_the_states_and_checkpointing_the_activations() -> None:
    base = load_config(EXAMPLE)
    params = estimate_parameters(base.model)
    fsdp = estimate_memory(base, params).parts
    ddp = estimate_memory(
        load_config(EXAMPLE, ["train.parallel=ddp", "train.fsdp_shard_size=null"]), params
    ).parts
    assert fsdp["optimizer"] * 8 == ddp["optimizer"] == 8 * params  # fp32 moments, shard group of 8
    assert fsdp["ema"] * 8 == ddp["ema"] == 4 * params
    no_ckpt = estimate_memory(load_config(EXAMPLE, ["train.activation_checkpointing=false"]), params).parts
    assert no_ckpt["activations"] > 2 * fsdp["activations"]


def test_the_budget_is_the_smallest_gpu_the_probe_sees_when_the_config_sets_none() -> None:
    gpus = {"torch": {"devices": [{"name": "NVIDIA A100-SXM4-40GB", "total_memory": 40 * 10**9}] * 8}}
    out = outcome(["train.memory_budget_gb=null"], gpus)
    assert out.status.value == "pass" and "(NVIDIA A100-SXM4-40GB as the probe sees it)" in out.finding
    out = outcome(["train.memory_budget_gb=null", "train.activation_checkpointing=false"], gpus)
    assert out.status.value == "fail"
    blind = outcome(["train.memory_budget_gb=null"])  # a login node without GPUs
    assert blind.status.value == "pass" and "not checked: no GPU visible here" in blind.finding


@pytest.mark.parametrize(("sets", "code"), [([], 0), (NOT_FITTING, 1)])
def test_hpclaunch_preflight_config_check_exit_code(sets: list[str], code: int, tmp_path: Path) -> None:
    args = [sys.executable, "-m", "hpclaunch", "preflight", str(EXAMPLE), "--only", "config", "--json"]
    for item in sets:
        args += ["--set", item]
    proc = subprocess.run(args, capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == code, proc.stdout + proc.stderr
    (check,) = json.loads(proc.stdout)["checks"]
    assert "memory per GPU ~" in check["finding"] and ("does not fit" in check["finding"]) == bool(code)


def test_the_largest_micro_batch_is_the_last_whose_estimate_fits() -> None:
    cfg = load_config(EXAMPLE)
    params = estimate_parameters(cfg.model)
    budget = estimate_memory(cfg, params).total  # exactly the configured micro-batch's estimate
    from hpclaunch.preflight.sizes import largest_micro_batch

    assert largest_micro_batch(cfg, params, budget) == cfg.micro_batch
    assert largest_micro_batch(cfg, params, budget - 1) == cfg.micro_batch - 1
    assert largest_micro_batch(cfg, params, 1) == 0  # not even one sample


def test_a_gpu_with_room_to_spare_is_told_which_micro_batch_fills_it() -> None:
    # 32 samples a rank in micro-batches of 4 on a 200 GB budget: far more fits.
    out = outcome(["train.micro_batch=4", "train.memory_budget_gb=200"])
    assert out.status.value == "pass", out
    (memory,) = [part for part in out.finding.split("; ") if part.startswith("memory per GPU")]
    assert "[fsdp, activation checkpointing, micro-batch 4" in memory
    assert "up to micro-batch" in out.finding
    assert "train.micro_batch 32 (no accumulation)" in out.finding
    # Without accumulation the way to fill it is a larger global batch.
    whole = outcome(["train.micro_batch=32", "train.memory_budget_gb=200"]).finding
    assert "a larger train.global_batch fills the GPU better" in whole and "(no accumulation)" not in whole
    # A budget the configured micro-batch just fits: nothing to add.
    assert "up to micro-batch" not in outcome(["train.memory_budget_gb=30"]).finding


def test_the_fast_mode_keeps_no_attention_matrix_so_more_fits() -> None:
    det = load_config(EXAMPLE, ["train.activation_checkpointing=false"])
    fast = load_config(EXAMPLE, ["train.activation_checkpointing=false", "train.deterministic=false"])
    params = estimate_parameters(det.model)
    assert (
        estimate_memory(fast, params).parts["activations"] < estimate_memory(det, params).parts["activations"]
    )


def test_one_rank_is_estimated_unwrapped_whatever_the_parallelism() -> None:
    """One GPU trains the model itself (``trainer.setup.parallel.wrap_model``): no FSDP buffers, no DDP
    buckets, autocast's bf16 weight copies; preflight says so instead of the parallelism."""
    one = [
        "scheduler.nodes=1",
        "scheduler.gpus_per_node=1",
        "scheduler.procs_per_node=1",
        "train.fsdp_shard_size=null",
    ]
    params = estimate_parameters(load_config(EXAMPLE).model)
    fsdp = estimate_memory(load_config(EXAMPLE, [*one, "train.parallel=fsdp"]), params)
    ddp = estimate_memory(load_config(EXAMPLE, [*one, "train.parallel=ddp"]), params)
    assert fsdp.parts == ddp.parts
    assert not fsdp.parts.get("fsdp_gathered")
    assert fsdp.parts["gradients"] == 4 * params and fsdp.parts["parameters"] == (4 + 2) * params
    memory = next(
        p for p in outcome([*one, "train.parallel=ddp"]).finding.split("; ") if p.startswith("memory per GPU")
    )
    assert "[one rank, unwrapped, activation checkpointing" in memory
