"""Preflight counts the staging copy of a background save in each node's host memory: a config whose
copy does not fit fails the ``config`` check, naming what it needs and what the node has."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.shm_fixtures import small_tmpfs

from hpclaunch.config import RunConfig, load_config
from hpclaunch.preflight.check_context import CheckContext
from hpclaunch.preflight.layout import check_config
from hpclaunch.preflight.probe import StaticProbe
from hpclaunch.preflight.sizes import (
    HOST_RUNTIME_BYTES,
    estimate_host_memory,
    estimate_memory,
    human_bytes,
    run_checkpoint_bytes,
)

PARAMS = 100_000_000  # 1.2 GB of weights and AdamW moments per checkpoint
RANKS = ["scheduler.procs_per_node=2", "train.global_batch=16"]


def cfg(*sets: str) -> RunConfig:
    return load_config(None, [*RANKS, *sets])


def outcome(c: RunConfig) -> Any:
    probe = StaticProbe({"torch": {"devices": []}, "model": {"params": PARAMS}})
    return check_config(CheckContext(cfg=c, node=None, probe=probe))


def test_each_rank_stages_its_part_of_the_checkpoint_beside_its_cpu_training_state() -> None:
    c = cfg()
    est = estimate_host_memory(c, PARAMS)
    assert est.ranks == 2
    assert est.parts["staging"] == run_checkpoint_bytes(c, PARAMS)  # DDP: every rank stages it all
    assert est.parts["training"] == estimate_memory(c, PARAMS).total  # CPU ranks train in host memory
    assert est.parts["runtime"] == HOST_RUNTIME_BYTES
    assert est.total == 2 * sum(est.parts.values())
    fsdp = estimate_host_memory(cfg("train.parallel=fsdp"), PARAMS)
    assert fsdp.parts["staging"] == est.parts["staging"] // 2  # FSDP: its shard only
    assert estimate_host_memory(cfg("checkpoint.async_save=false"), PARAMS).parts["staging"] == 0
    gpus = estimate_host_memory(cfg("scheduler.gpus_per_node=2"), PARAMS)
    assert gpus.parts["training"] == 0 and gpus.parts["staging"] == est.parts["staging"]  # pinned copy


def test_a_staging_copy_that_does_not_fit_fails_naming_both_figures() -> None:
    without_staging = estimate_host_memory(cfg("checkpoint.async_save=false"), PARAMS).total
    with_staging = estimate_host_memory(cfg(), PARAMS).total
    mem_gb = (without_staging + with_staging) / 2 / 1e9  # fits only without the staging copy
    out = outcome(cfg(f"scheduler.mem_gb={mem_gb}"))
    assert out.status.value == "fail", out
    assert f"host memory per node ~{human_bytes(with_staging)} (2 rank(s) x (staging copy " in out.finding
    assert f"does not fit {human_bytes(int(mem_gb * 1e9))} (scheduler.mem_gb)" in out.finding
    assert "\n" not in out.finding
    assert out.hint is not None and "checkpoint.async_save: false" in out.hint
    fits = outcome(cfg(f"scheduler.mem_gb={mem_gb}", "checkpoint.async_save=false"))
    assert fits.status.value == "pass", fits
    assert f"fits {human_bytes(int(mem_gb * 1e9))} (scheduler.mem_gb)" in fits.finding


def test_without_mem_gb_the_local_node_is_this_machine_and_a_cluster_node_is_not_known() -> None:
    local = outcome(cfg())
    assert "memory)" in local.finding and "host memory per node ~" in local.finding
    slurm = outcome(cfg("scheduler.kind=slurm"))
    assert "not checked: the nodes' memory is unknown here (set scheduler.mem_gb" in slurm.finding


def test_hpclaunch_preflight_exits_1_with_the_finding(tmp_path: Path) -> None:
    config = tmp_path / "run.yaml"
    config.write_text("name: host-memory\n")
    sets = ["scheduler.mem_gb=0.5", "model.depth=8", "model.dim_text=512", "model.dim_latent=512"]
    args = [sys.executable, "-m", "hpclaunch", "preflight", str(config), "--only", "config", "--json"]
    for item in sets:
        args += ["--set", item]
    proc = subprocess.run(args, capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    (check,) = json.loads(proc.stdout)["checks"]
    assert "does not fit 476.8 MiB (scheduler.mem_gb)" in check["finding"]
    assert "staging copy" in check["finding"]


def test_the_memory_tier_counts_its_staging_copy_and_the_snapshots_the_node_keeps() -> None:
    whole = run_checkpoint_bytes(cfg(), PARAMS)
    off = estimate_host_memory(cfg(), PARAMS)
    on = estimate_host_memory(cfg("checkpoint.memory.every_steps=5", "checkpoint.memory.keep_last=2"), PARAMS)
    assert off.parts["snapshots"] == 0
    # DDP: each rank stages it all and its snapshots hold it all (rank-local): 3 of them in the
    # node's tmpfs (2 kept, 1 being written)
    assert on.parts["snapshots"] == whole + whole * 3
    # on two nodes each rank also keeps its ward's 3; FSDP over 4 ranks: a quarter of each
    two = ["scheduler.kind=slurm", "scheduler.nodes=2", "checkpoint.memory.every_steps=5"]
    assert estimate_host_memory(cfg(*two), PARAMS).parts["snapshots"] == whole + whole * 6
    fsdp = estimate_host_memory(cfg(*two, "train.parallel=fsdp"), PARAMS).parts["snapshots"]
    assert fsdp == whole // 4 + whole // 4 * 6
    assert "memory tier" in on.describe() and on.total > off.total
    mem_gb = (off.total + on.total) / 2 / 1e9  # fits only without the memory tier
    assert outcome(cfg(f"scheduler.mem_gb={mem_gb}")).status.value == "pass"
    refused = outcome(cfg(f"scheduler.mem_gb={mem_gb}", "checkpoint.memory.every_steps=5"))
    assert refused.status.value == "fail" and "memory tier" in refused.finding
    assert refused.hint is not None and "checkpoint.memory.keep_last" in refused.hint


def test_the_memory_tier_counts_its_own_its_wards_and_a_restores_shard(tmp_path: Path) -> None:
    from hpclaunch.preflight.sizes import snapshot_bytes_per_rank, snapshot_shard_bytes

    one = cfg("checkpoint.memory.every_steps=5")
    shard = snapshot_shard_bytes(one, PARAMS)
    assert shard == run_checkpoint_bytes(one, PARAMS)  # DDP: each rank's snapshot holds it all
    # keep_last 2 and one being written, and the staging copy (or a restore's received shard)
    assert snapshot_bytes_per_rank(one, PARAMS) == shard * 3 + shard
    two = cfg("checkpoint.memory.every_steps=5", "scheduler.kind=slurm", "scheduler.nodes=2")
    assert snapshot_bytes_per_rank(two, PARAMS) == shard * 3 * 2 + shard  # and the ward's copies
    assert estimate_host_memory(two, PARAMS).parts["snapshots"] == snapshot_bytes_per_rank(two, PARAMS)


def test_a_tmpfs_too_small_for_the_snapshots_is_a_warning_naming_both_figures(tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "shm", "1m") as shm:
        out = outcome(cfg("checkpoint.memory.every_steps=5", f"checkpoint.memory.dir={shm}"))
    assert out.status.value == "warn", out
    assert f"in {shm} does not fit its 1.0 MiB free: the tier would step aside" in out.finding
    assert out.hint is not None and "checkpoint.memory.keep_last" in out.hint
    roomy = outcome(
        cfg("checkpoint.memory.every_steps=5", "model.depth=1", f"checkpoint.memory.dir={tmp_path}")
    )
    assert "memory tier ~" in roomy.finding and "fits its" in roomy.finding
