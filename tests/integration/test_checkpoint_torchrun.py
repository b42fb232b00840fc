"""Checkpoints across real processes: torchrun with 2-3 gloo ranks, and a real SIGKILL mid-save.

Each test launches tests/integration/helpers/ckpt_worker.py; the worker writes one JSON result per
rank, which the test reads.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hpclaunch.rank.checkpoint import ENV_DELAY_WRITE, ENV_FAIL, ENV_KILL, Checkpointer, RunCheckpoints
from hpclaunch.rundir import CHECKPOINT_INVALID, CHECKPOINT_SAVED, RunPaths, read_events

pytestmark = pytest.mark.slow

WORKER = Path(__file__).parent / "helpers" / "ckpt_worker.py"


def launch(
    run_dir: Path,
    mode: str,
    *,
    nproc: int | None,
    kill: str | None = None,
    fail: str | None = None,
    extra_env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """torchrun (nproc ranks) or, with nproc=None, plain python (one process, no torch.distributed)."""
    env = {k: v for k, v in os.environ.items() if k not in (ENV_KILL, ENV_DELAY_WRITE, ENV_FAIL)}
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra_env or {})
    if kill:
        env[ENV_KILL] = kill
    if fail:
        env[ENV_FAIL] = fail
    prefix = [sys.executable]
    if nproc is not None:
        prefix += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    cmd = [*prefix, str(WORKER), mode, str(run_dir)]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)


def results(run_dir: Path, mode: str, nproc: int) -> list[dict[str, Any]]:
    return [json.loads((run_dir / f"result-{mode}-rank{r}.json").read_text()) for r in range(nproc)]


def ok(proc: subprocess.CompletedProcess[str]) -> None:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


def events(run_dir: Path, name: str) -> list[dict[str, Any]]:
    return [e.record for e in read_events(RunPaths(run_dir)).events if e.event == name]


def test_resume_on_two_ranks_is_bitwise_identical_to_an_uninterrupted_run(tmp_path: Path) -> None:
    # DDP + AdamW, per-rank torch and Python RNG; saved async at step 4 while the live tensors are
    # changed right after save() returns, loaded into freshly built objects, trained 4 more steps.
    ok(launch(tmp_path, "roundtrip", nproc=2))
    for rank, res in enumerate(results(tmp_path, "roundtrip", 2)):
        assert res["loaded_step"] == 4 and res["progress_step"] == 4 and res["samples"] == 32, rank
        assert res["manifest_extra"] == {"samples_consumed": 32}
        assert res["staged_mismatch"] == [], f"rank {rank}: checkpoint saw post-save mutations"
        assert res["final_mismatch"] == [], f"rank {rank}: resumed run diverged"
        assert res["stall_s"] < 0.5 <= res["save_s"]  # writer was delayed 1 s; training was not
    (saved,) = events(tmp_path, CHECKPOINT_SAVED)
    assert saved["step"] == 4 and saved["blocking"] is False and saved["stall_s"] < 0.5


def test_kill_9_mid_save_resumes_from_the_previous_checkpoint(tmp_path: Path) -> None:
    ckpts = tmp_path / "checkpoints"
    # Rank 1 SIGKILLs itself after writing its data files of step 20, before .metadata exists.
    crashed = launch(tmp_path, "crash", nproc=2, kill="20:1:data")
    assert crashed.returncode != 0
    assert "Signal 9 (SIGKILL) received" in crashed.stdout + crashed.stderr
    (leftover,) = ckpts.glob(".step_000020.tmp-*")
    assert not (ckpts / "step_000020").exists() and (ckpts / "step_000010").exists()

    ok(launch(tmp_path, "resume", nproc=2))
    for res in results(tmp_path, "resume", 2):
        assert res["loaded_step"] == 10 and res["model_ok"] and res["progress_step"] == 10
        ((path, reason),) = res["skipped"]
        assert Path(path).name == leftover.name and reason.startswith("never published")
        assert res["ranks_without_rank_local"] == []
    assert [r["rank_local_value"] for r in results(tmp_path, "resume", 2)] == [1000.0, 1001.0]
    assert not leftover.exists()
    (invalid,) = events(tmp_path, CHECKPOINT_INVALID)
    assert Path(invalid["path"]).name == leftover.name

    # The same checkpoint on 3 ranks: rank 2 has no saved RNG/local state and keeps its own.
    ok(launch(tmp_path, "resume", nproc=3))
    got = results(tmp_path, "resume", 3)
    assert all(r["loaded_step"] == 10 and r["model_ok"] and r["skipped"] == [] for r in got)
    assert all(r["ranks_without_rank_local"] == [2] for r in got)
    assert [r["rank_local_value"] for r in got] == [1000.0, 1001.0, -98.0]


def test_kill_9_after_metadata_before_publish_leaves_nothing_loadable(tmp_path: Path) -> None:
    ckpts = tmp_path / "checkpoints"
    crashed = launch(tmp_path, "crash", nproc=None, kill="20:0:publish")
    assert crashed.returncode == -9, crashed.stderr[-3000:]
    (leftover,) = ckpts.glob(".step_000020.tmp-*")
    assert (leftover / ".metadata").exists() and not (leftover / "manifest.json").exists()

    import torch

    state = {"model": {"w": torch.zeros(2_000_000), "b": torch.zeros(10)}}
    state |= {"progress": {"step": torch.tensor(-1)}, "rank_local": {"rank0": {"buf": torch.zeros(500_000)}}}
    ck = Checkpointer(RunCheckpoints(ckpts, 1, config_hash="cfg", model_hash="toy-v1", keep_last=3), rank=0)
    result = ck.load_latest(state)
    assert result is not None and result.info.step == 10
    assert [p.name for p, _ in result.skipped] == [leftover.name]
    assert int(state["progress"]["step"]) == 10 and float(state["model"]["w"][0]) == 10.0


def test_disk_full_injected_enospc_on_one_of_two_ranks_is_said_in_the_users_words_on_both(
    tmp_path: Path,
) -> None:
    # Rank 1's DCP filesystem writer fails with ENOSPC (injected); DCP hands the failure to every
    # rank, and every rank says it the same way: where, how much is free, how much is needed.
    ok(launch(tmp_path, "diskfull", nproc=2, fail="ENOSPC@30:1"))
    got = results(tmp_path, "diskfull", 2)
    needed = "the checkpoint needs about 11.4 MiB (saving step 30)"  # 8 MB shared + 2 x 2 MB rank-local
    for res in got:
        assert res["error"].startswith(f"no space left on {tmp_path / 'checkpoints'}: "), res
        assert res["error"].endswith(f" free, {needed}") and "checkpoint.dir" in res["hint"]
    assert not list((tmp_path / "checkpoints").iterdir())  # the partial save was removed
