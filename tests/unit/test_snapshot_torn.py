"""A snapshot is never torn, and its job's failures are told apart from bugs (issue 38): the live
tensors are not changed while its staging copies may still read them (a skipped step's evaluation
swaps the EMA into the parameters; a close frees the staging buffer), and a bug in a job fails the
rank where a full tmpfs only fails the snapshot. One process, the real trainer and tier."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tests.unit.tiny_model import tiny_model

from hpclaunch.config import RunConfig, load_config
from hpclaunch.rank.checkpoint.fault_hooks import ENV_SNAPSHOT_DELAY_COPY
from hpclaunch.rank.checkpoint.staging import SharedStager
from hpclaunch.rank.snapshots.store import NodeStore
from hpclaunch.rank.snapshots.transfer import JobThread, Link, SnapshotJob, SnapshotPlace
from hpclaunch.rundir import RunPaths
from hpclaunch.rundir.shm import user_root
from hpclaunch.shards import synth_dataset
from hpclaunch.trainer.loop import Trainer

MODEL = tiny_model(2)

pytestmark = [pytest.mark.fast, pytest.mark.usefixtures("in_process_trainer")]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("data")
    synth_dataset(root, samples=160, seed=0, model_cfg=load_config(None, MODEL).model, shard_size=64)
    return root


def config(tmp_path: Path, data: Path, *overrides: str) -> RunConfig:
    (tmp_path / "shm").mkdir(exist_ok=True)
    return load_config(
        None,
        [
            *MODEL, "scheduler.procs_per_node=1", "train.steps=8", "train.global_batch=8",
            "train.lr=3e-3", "train.warmup_steps=1", "train.log_every=1", "data.num_workers=0",
            "preflight.distributed_smoke=false", f"data.token_dir={data / 'tokens'}",
            f"data.latent_dir={data / 'latents'}", "checkpoint.every_steps=1000",
            "checkpoint.memory.every_steps=2", f"checkpoint.memory.dir={tmp_path / 'shm'}",
            *overrides,
        ],
        base=tmp_path,
    )  # fmt: skip


def test_a_skipped_step_waits_for_the_snapshots_copies_before_an_evaluation_swaps_the_ema_in(
    tmp_path: Path, data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Step 3 is skipped (non-finite) and evaluates with the EMA's weights swapped into the
    parameters; the snapshot of step 2 copies them meanwhile (its copy held back 1 s here). Only
    an applied step waited for the copies before (the optimizer's step): the snapshot could hold
    the EMA as the weights. The evaluation waits for them before it swaps."""
    monkeypatch.setenv(ENV_SNAPSHOT_DELAY_COPY, "1")
    cfg = config(
        tmp_path, data, "train.ema_decay=0.9", "data.val_fraction=0.2", "train.eval_every=3",
        "train.eval_samples=8", "testing.inject_nonfinite_at=[3]",
    )  # fmt: skip
    tr = Trainer(cfg, RunPaths(tmp_path / "run").ensure(), echo=False)
    try:
        tr.resume()
        assert tr.run_state.saves.memory is not None
        for _ in range(2):
            tr.train_step()
        tr.run_state.saves.memory.after_step(2, tr.snapshot_state, disk_save_now=False)
        job = tr.run_state.saves.memory.job
        assert job is not None and job.staged is not None and not job.staged.copied.is_set()
        applied, *_ = tr.train_step()  # step 3
        assert not applied
        assert tr.ema is not None
        swap, seen = tr.ema.applied, []

        def applied_after_the_copies(*args: object, **kwargs: object) -> object:
            seen.append(job.staged is not None and job.staged.copied.is_set())
            return swap(*args, **kwargs)  # type: ignore[arg-type]

        tr.ema.applied = applied_after_the_copies  # type: ignore[method-assign]
        tr.evaluate()
        assert seen == [True]  # the copies were done when the EMA was swapped in
    finally:
        tr.close()


def _job(store: NodeStore | None, describe: object, step: int = 5) -> SnapshotJob:
    staged, finish = SharedStager().stage_later({"w": torch.arange(4.0)})
    job = SnapshotJob(
        SnapshotPlace(store, world=1, rank=0, link=Link(None, None), keep_last=2),
        staged=staged, finish=finish, describe=describe,  # type: ignore[arg-type]
        step=step,
    )  # fmt: skip
    jobs = JobThread()
    jobs.submit(job)
    assert job.join(timeout=60)
    jobs.close()
    return job


def test_a_bug_in_a_snapshots_job_fails_the_rank_and_a_failed_write_only_the_snapshot(tmp_path: Path) -> None:
    """``except Exception`` said every bug as ``snapshot_failed`` (and the disk tier served for ever)."""
    (tmp_path / "shm").mkdir()
    store = NodeStore(user_root(tmp_path / "shm") / "run", tmp_path / "shm", "n0", "1.0")

    def buggy(staged: object, crc: int) -> bytes:
        return {}["no such key"]  # type: ignore[no-any-return]

    job = _job(store, buggy)
    assert isinstance(job.crash, KeyError) and job.error is None
    assert job.staged is not None and job.staged.copied.is_set()  # (the optimizer never waits for ever)
    store.directory.chmod(0o755)  # the tier's place no longer private: a failure, said, not a bug
    job = _job(store, lambda staged, crc: b"{}", step=10)
    assert job.crash is None and job.error is not None and "open to other users" in job.error
