"""The process writer in one training process (torch.distributed not initialized, or a one-rank
group for DTensors): the save is written by another process from shared memory; a killed writer,
a full disk, a kill before publishing; DTensor shards without their mesh."""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from tests.unit.checkpointers import checkpointer as flat_checkpointer

from hpclaunch.errors import CheckpointError
from hpclaunch.rank.checkpoint import (
    ENV_DELAY_WRITE,
    ENV_FAIL,
    ENV_KILL,
    MANIFEST_NAME,
    METADATA_NAME,
    RANK_LOCAL,
    Checkpointer,
    rank_local_key,
)
from hpclaunch.rank.helper_signals import STOP_SIGNALS
from hpclaunch.rundir import CHECKPOINT_SAVED, Ledger, RunPaths, read_events


def make(tmp_path: Path, **kw: Any) -> Checkpointer:
    args: dict[str, Any] = {
        "rank": 0,
        "world_size": 1,
        "config_hash": "cfg",
        "model_hash": "model-a",
        "keep_last": 10,
        "writer": "process",
        # Normal priority: on a loaded machine an idle-priority writer the test waits for is replaced
        # (test_checkpoint_writer_starved), which these tests of one writer must not see.
        "writer_idle": False,
        "ledger": Ledger(RunPaths(tmp_path), role="trainer"),
    }
    args.update(kw)
    return flat_checkpointer(tmp_path / "ckpt", **args)


def state_at(step: int) -> dict[str, Any]:
    return {
        "model": {"w": torch.full((64, 64), float(step)), "h": torch.arange(5, dtype=torch.bfloat16)},
        "progress": {"step": torch.tensor(step), "samples": step * 10, "tag": f"s{step}"},
        "sched": {"betas": (0.9, 0.99), "lrs": [0.1, 0.2], "none": None, "empty": torch.zeros(0)},
        RANK_LOCAL: {rank_local_key(0): {"torch_rng": torch.get_rng_state(), "py": random.getstate()}},
    }


def blank() -> dict[str, Any]:
    return {
        "model": {"w": torch.zeros(64, 64), "h": torch.zeros(5, dtype=torch.bfloat16)},
        "progress": {"step": torch.tensor(-1), "samples": 0, "tag": ""},
        "sched": {"betas": (0.0, 0.0), "lrs": [], "none": 1, "empty": torch.ones(0)},
        RANK_LOCAL: {rank_local_key(0): {"torch_rng": torch.zeros(5056, dtype=torch.uint8), "py": None}},
    }


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_the_save_is_written_by_another_process_from_what_was_staged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_DELAY_WRITE, "0.5")  # the writer starts after the mutation below
    ck = make(tmp_path)
    live = state_at(5)
    ck.save(5, live, blocking=False)
    pid = ck.writer_pid
    assert pid is not None and pid != os.getpid() and alive(pid)
    live["model"]["w"].add_(100.0)  # in place, as an optimizer step would
    live["progress"]["step"].fill_(99)
    assert not (tmp_path / "ckpt" / "step_000005").exists()
    ck.wait()
    monkeypatch.delenv(ENV_DELAY_WRITE)
    ck.save(6, state_at(6), blocking=False)  # the same writer, the same staging buffer
    assert ck.writer_pid == pid
    ck.close()
    assert not alive(pid)  # close() ends it
    into = blank()
    result = make(tmp_path).load_latest(into)
    assert result is not None and result.info.step == 6
    expected = state_at(6)
    assert torch.equal(into["model"]["w"], expected["model"]["w"])
    assert torch.equal(into["model"]["h"], expected["model"]["h"])
    assert into["progress"] == {"step": torch.tensor(6), "samples": 60, "tag": "s6"}
    assert into["sched"]["betas"] == (0.9, 0.99) and into["sched"]["lrs"] == [0.1, 0.2]
    assert into["sched"]["none"] is None and into["sched"]["empty"].numel() == 0
    assert into[RANK_LOCAL]["rank0"]["py"] == expected[RANK_LOCAL]["rank0"]["py"]  # a tuple again
    saved = [
        e
        for e in [e.record for e in read_events(RunPaths(tmp_path)).events]
        if e["event"] == CHECKPOINT_SAVED
    ]
    assert [(e["step"], e["blocking"], e["writer"]) for e in saved] == [
        (5, False, "process"),
        (6, False, "process"),
    ]
    assert [i.step for i in make(tmp_path).list_valid()] == [5, 6]


def test_a_new_structure_gets_a_new_staging_buffer(tmp_path: Path) -> None:
    ck = make(tmp_path)
    ck.save(1, state_at(1), blocking=False)
    changed = state_at(2)
    changed["model"]["w"] = torch.full((32, 80), 2.0)
    changed["model"]["new"] = torch.arange(7.0)
    ck.save(2, changed, blocking=False)
    ck.close()
    into = blank()
    into["model"]["w"], into["model"]["new"] = torch.zeros(32, 80), torch.zeros(7)
    assert make(tmp_path).load_latest(into) is not None
    assert torch.equal(into["model"]["w"], changed["model"]["w"])
    assert torch.equal(into["model"]["new"], changed["model"]["new"])


def test_a_killed_writer_fails_its_save_and_a_new_writer_takes_the_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ck = make(tmp_path)
    ck.save(4, state_at(4), blocking=False)
    first = ck.writer_pid
    assert first is not None
    monkeypatch.setenv(ENV_KILL, "5:0:data:writer")  # the writer SIGKILLs itself mid-write
    ck.save(5, state_at(5), blocking=False)
    with pytest.raises(
        CheckpointError, match=rf"writer process of rank 0 \(pid {first}\) died \(killed by SIGKILL\)"
    ):
        ck.wait()
    assert not alive(first) and ck.writer_pid is None
    (leftover,) = (tmp_path / "ckpt").glob(".step_000005.tmp-*")  # the resume removes it
    monkeypatch.delenv(ENV_KILL)
    ck.save(5, state_at(5), blocking=True)  # the trainer's blocking retry
    ck.save(6, state_at(6), blocking=False)
    assert ck.writer_pid not in (None, first)
    ck.close()
    assert [i.step for i in make(tmp_path).list_valid()] == [4, 5, 6]
    result = make(tmp_path).load_latest(blank())
    assert result is not None and result.info.step == 6
    assert [p.name for p, _ in result.skipped] == [] and not leftover.exists()


def test_a_writer_killed_before_it_publishes_leaves_nothing_loadable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ck = make(tmp_path)
    monkeypatch.setenv(ENV_KILL, "5:0:publish:writer")  # after .metadata, before the manifest
    ck.save(5, state_at(5), blocking=False)
    with pytest.raises(CheckpointError, match="died"):
        ck.wait()
    ck.close()
    (leftover,) = (tmp_path / "ckpt").glob(".step_000005.tmp-*")
    assert (leftover / METADATA_NAME).exists() and not (leftover / MANIFEST_NAME).exists()
    result = make(tmp_path).load_latest(blank())
    assert result is None and not leftover.exists()


def test_disk_full_in_the_writer_is_said_in_the_users_words(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ck = make(tmp_path)
    monkeypatch.setenv(ENV_FAIL, "ENOSPC@5")
    ck.save(5, state_at(5), blocking=False)
    with pytest.raises(CheckpointError) as err:
        ck.wait()
    assert err.value.one_line().startswith(f"no space left on {tmp_path / 'ckpt'}: ")
    assert "the checkpoint needs about" in err.value.one_line() and err.value.hint
    assert not list((tmp_path / "ckpt").iterdir())  # the partial save was removed
    writer = ck.writer_pid
    monkeypatch.delenv(ENV_FAIL)
    ck.save(6, state_at(6), blocking=False)  # a writer that reported a failure is replaced too
    assert ck.writer_pid not in (None, writer)
    ck.close()
    assert [i.step for i in make(tmp_path).list_valid()] == [6]


@pytest.fixture
def one_rank_group() -> Any:
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_dtensor_shards_go_through_the_writer_without_their_mesh(tmp_path: Path, one_rank_group: Any) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    weight = torch.arange(48.0).reshape(6, 8)
    state = {"model": {"w": distribute_tensor(weight, mesh, [Shard(0)]), "b": torch.ones(3)}}
    ck = make(tmp_path)
    ck.save(1, state, blocking=False)
    ck.close()
    as_dtensor = {"model": {"w": distribute_tensor(torch.zeros(6, 8), mesh, [Shard(0)]), "b": torch.zeros(3)}}
    assert make(tmp_path).load_latest(as_dtensor) is not None
    assert torch.equal(as_dtensor["model"]["w"].full_tensor(), weight)
    plain = {"model": {"w": torch.zeros(6, 8), "b": torch.zeros(3)}}  # as DDP would load it
    assert make(tmp_path).load_latest(plain) is not None
    assert torch.equal(plain["model"]["w"], weight) and torch.equal(plain["model"]["b"], torch.ones(3))


def test_retention_in_the_writer_keeps_the_last_valid_ones_and_sets_a_corrupt_one_aside(
    tmp_path: Path,
) -> None:
    from hpclaunch.rundir import CHECKPOINT_INVALID

    ck = make(tmp_path, keep_last=2)
    ck.save(1, state_at(1), blocking=True)
    ck.save(2, state_at(2), blocking=True)
    data = tmp_path / "ckpt" / "step_000002" / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # same size: only the sha256 can tell
    data.write_bytes(bytes(raw))
    later = make(tmp_path, keep_last=2)  # another attempt: knows nothing of step 2 yet
    later.save(3, state_at(3), blocking=False)  # retention runs in the writer process
    later.close()
    # The last two valid ones are 1 and 3: the corrupt 2 is set aside, never counted.
    assert [i.step for i in make(tmp_path).list_valid()] == [1, 3]
    assert (tmp_path / "ckpt" / "step_000002.corrupt").is_dir()
    (invalid,) = [
        e
        for e in [e.record for e in read_events(RunPaths(tmp_path)).events]
        if e["event"] == CHECKPOINT_INVALID
    ]
    assert invalid["reason"].startswith("sha256 mismatch")  # found by the writer, in the run's ledger
    assert invalid["writer"] == "trainer"
    for step in (4, 5):
        later = make(tmp_path, keep_last=2)
        later.save(step, state_at(step), blocking=False)
        later.close()
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        "step_000002.corrupt",
        "step_000004",
        "step_000005",
    ]


@pytest.mark.parametrize("sig", STOP_SIGNALS, ids=lambda s: signal.Signals(s).name)
def test_a_writer_sent_a_stop_signal_survives_and_finishes_its_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sig: int
) -> None:
    """Schedulers signal every process of the job (the time-limit warning included): the writer is
    a helper of its rank and follows the helpers' one policy, as the DataLoader workers do. Sent
    once while it starts (still importing) and again in the middle of its write."""
    monkeypatch.setenv(ENV_DELAY_WRITE, "1.0")
    ck = make(tmp_path)
    ck.save(3, state_at(3), blocking=False)
    pid = ck.writer_pid
    assert pid is not None
    os.kill(pid, sig)  # start-up: before the writer's own code runs
    time.sleep(0.6)
    os.kill(pid, sig)  # mid-save (or still starting on a loaded machine)
    ck.wait()  # raises CheckpointError "... died (killed by SIG...)" when the writer died
    assert alive(pid) and ck.writer_pid == pid
    ck.close()
    assert [i.step for i in make(tmp_path).list_valid()] == [3]


def test_the_writer_process_writes_with_the_threads_it_was_given(tmp_path: Path) -> None:
    ck = make(tmp_path, write_threads=2)
    ck.save(4, state_at(4), blocking=False)
    ck.wait()
    ck.close()
    assert len(list((tmp_path / "ckpt" / "step_000004").glob("*.distcp"))) == 2
    into = blank()
    result = make(tmp_path).load_latest(into)
    assert result is not None and result.info.step == 4
    assert torch.equal(into["model"]["w"], state_at(4)["model"]["w"])
