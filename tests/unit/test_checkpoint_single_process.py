"""Checkpointer in one process (torch.distributed not initialized): save, publish, load, retain."""

from __future__ import annotations

import json
import os
import random
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from tests.unit.checkpointers import checkpointer as flat_checkpointer

from hpclaunch.errors import CheckpointError
from hpclaunch.rank.checkpoint import (
    ENV_DELAY_WRITE,
    MANIFEST_NAME,
    RANK_LOCAL,
    Checkpointer,
    file_digest,
    rank_local_key,
    step_dir_name,
)
from hpclaunch.rank.checkpoint import writing as writing_mod
from hpclaunch.rundir import CHECKPOINT_INVALID, CHECKPOINT_SAVED, Ledger, RunPaths, read_events

pytestmark = pytest.mark.fast


def make(tmp_path: Path, **kw: Any) -> Checkpointer:
    args: dict[str, Any] = {
        "rank": 0,
        "world_size": 1,
        "config_hash": "cfg",
        "model_hash": "model-a",
        "keep_last": 10,
        "ledger": Ledger(RunPaths(tmp_path), role="trainer"),
    }
    args.update(kw)
    return flat_checkpointer(tmp_path / "ckpt", **args)


def state_at(step: int) -> dict[str, Any]:
    return {
        "model": {"w": torch.full((64, 64), float(step)), "h": torch.arange(5, dtype=torch.bfloat16)},
        "progress": {"step": torch.tensor(step), "samples": step * 10, "tag": f"s{step}"},
        "sched": {"last_epoch": step, "base_lrs": [0.1, 0.2], "betas": (0.9, 0.99), "none": None},
        RANK_LOCAL: {rank_local_key(0): {"torch_rng": torch.get_rng_state(), "py": random.getstate()}},
    }


def blank() -> dict[str, Any]:
    return {
        "model": {"w": torch.zeros(64, 64), "h": torch.zeros(5, dtype=torch.bfloat16)},
        "progress": {"step": torch.tensor(-1), "samples": 0, "tag": ""},
        "sched": {"last_epoch": 0, "base_lrs": [], "betas": (0.0, 0.0), "none": 1},
        RANK_LOCAL: {rank_local_key(0): {"torch_rng": torch.zeros(5056, dtype=torch.uint8), "py": None}},
    }


def events(tmp_path: Path, name: str) -> list[dict[str, Any]]:
    return [e.record for e in read_events(RunPaths(tmp_path)).events if e.event == name]


def test_blocking_save_publishes_a_complete_directory_and_loads_back_exactly(tmp_path: Path) -> None:
    ck = make(tmp_path)
    saved = state_at(12)
    ck.save(12, saved, blocking=True, extra={"samples_consumed": 120})
    path = tmp_path / "ckpt" / "step_000012"
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step_000012"]  # no tmp dirs
    manifest = json.loads((path / MANIFEST_NAME).read_text())
    on_disk = {p.name for p in path.iterdir()} - {MANIFEST_NAME}
    assert set(manifest["files"]) == on_disk and ".metadata" in on_disk
    for name, entry in manifest["files"].items():
        assert file_digest(path / name) == (entry["bytes"], entry["sha256"])
    assert manifest["extra"] == {"samples_consumed": 120}
    assert manifest["torch_version"] == torch.__version__

    into = blank()
    result = make(tmp_path).load_latest(into)
    assert result is not None and result.info.step == 12 and result.skipped == []
    assert torch.equal(into["model"]["w"], saved["model"]["w"])
    assert torch.equal(into["model"]["h"], saved["model"]["h"])
    assert into["progress"] == {"step": torch.tensor(12), "samples": 120, "tag": "s12"}
    assert into["sched"] == saved["sched"]
    local = into[RANK_LOCAL][rank_local_key(0)]
    assert torch.equal(local["torch_rng"], saved[RANK_LOCAL]["rank0"]["torch_rng"])
    assert local["py"] == saved[RANK_LOCAL]["rank0"]["py"]
    random.setstate(local["py"])  # the Python RNG state survives weights_only loading

    (saved_event,) = events(tmp_path, CHECKPOINT_SAVED)
    assert saved_event["step"] == 12 and saved_event["blocking"] is True
    assert saved_event["bytes"] == manifest["total_bytes"] and saved_event["seconds"] >= 0
    assert saved_event["stall_s"] + 0.001 >= saved_event["seconds"]  # blocking: stall covers it
    assert ck.last_save_seconds is not None and ck.last_stall_seconds is not None


@pytest.mark.spawns
def test_async_save_stages_a_copy_and_returns_before_writing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_DELAY_WRITE, "0.5")  # the writer starts after the mutation below
    ck = make(tmp_path)
    live = state_at(5)
    ck.save(5, live, blocking=False)
    live["model"]["w"].add_(100.0)  # in place, as an optimizer step would
    live["progress"]["step"].fill_(99)
    assert ck.last_stall_seconds is not None and ck.last_stall_seconds < 0.5
    assert not (tmp_path / "ckpt" / "step_000005").exists()  # not published yet
    ck.wait()
    assert ck.last_save_seconds is not None and ck.last_save_seconds >= 0.5
    into = blank()
    assert make(tmp_path).load_latest(into) is not None
    assert torch.equal(into["model"]["w"], torch.full((64, 64), 5.0))
    assert int(into["progress"]["step"]) == 5
    (event,) = events(tmp_path, CHECKPOINT_SAVED)
    assert event["blocking"] is False and event["stall_s"] < 0.5 <= event["seconds"]


@pytest.mark.spawns
def test_next_save_waits_for_the_previous_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_DELAY_WRITE, "0.3")
    ck = make(tmp_path)
    ck.save(1, state_at(1), blocking=False)
    monkeypatch.delenv(ENV_DELAY_WRITE)
    ck.save(2, state_at(2), blocking=False)  # first waits for step 1 to be published
    assert (tmp_path / "ckpt" / "step_000001" / MANIFEST_NAME).exists()
    assert ck.last_stall_seconds is not None and ck.last_stall_seconds > 0.2
    ck.close()
    assert [i.step for i in ck.list_valid()] == [1, 2]


@pytest.mark.spawns
def test_saving_an_already_published_step_is_skipped(tmp_path: Path) -> None:
    ck = make(tmp_path)
    ck.save(3, state_at(3), blocking=False)
    ck.save(3, state_at(333), blocking=True)  # the stop save right after a periodic one
    into = blank()
    assert make(tmp_path).load_latest(into) is not None
    assert float(into["model"]["w"][0, 0]) == 3.0
    assert len(events(tmp_path, CHECKPOINT_SAVED)) == 1


def test_a_published_directory_without_manifest_is_moved_aside_and_saved_again(tmp_path: Path) -> None:
    ck = make(tmp_path)
    stale = tmp_path / "ckpt" / step_dir_name(4)
    stale.mkdir(parents=True)
    (stale / "junk").write_text("not a checkpoint")
    ck.save(4, state_at(4), blocking=True)
    assert not (stale / "junk").exists() and (stale / MANIFEST_NAME).exists()
    assert sorted(p.name for p in stale.parent.iterdir()) == ["step_000004", "step_000004.corrupt"]
    assert (stale.parent / "step_000004.corrupt" / "junk").read_text() == "not a checkpoint"
    (event,) = events(tmp_path, CHECKPOINT_INVALID)
    assert event["reason"].startswith("no manifest.json") and event["moved_to"].endswith(".corrupt")


@pytest.mark.spawns
def test_retention_keeps_last_k_and_every_nth(tmp_path: Path) -> None:
    ck = make(tmp_path, keep_last=2, keep_every=3)
    for step in range(1, 8):
        ck.save(step, state_at(step), blocking=False)
    ck.close()
    remaining = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert remaining == ["step_000003", "step_000006", "step_000007"]


def test_retention_never_deletes_the_checkpoint_just_written(tmp_path: Path) -> None:
    ck = make(tmp_path, keep_last=1)
    ck.save(100, state_at(100), blocking=True)
    ck.save(50, state_at(50), blocking=True)  # older step number, still just written
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step_000050", "step_000100"]


def test_background_error_surfaces_on_wait_and_the_next_save_works(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ck = make(tmp_path, writer="thread")  # the patch below reaches a writer in this process only

    def disk_full(path: Path, obj: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(writing_mod, "atomic_write_json", disk_full)
    ck.save(1, state_at(1), blocking=False)
    with pytest.raises(
        CheckpointError, match=r"no space left on .*/ckpt: .* free, the checkpoint needs about"
    ):
        ck.wait()
    monkeypatch.undo()
    ck.save(2, state_at(2), blocking=True)
    assert [i.step for i in ck.list_valid()] == [2]
    ck.close()


@pytest.mark.spawns
def test_saves_reuse_their_plan_and_a_changed_state_is_planned_again(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.planner import SavePlanner

    ck, other = make(tmp_path), make(tmp_path / "other")
    key = ck._plans._key
    ck.save(1, state_at(1), blocking=True)
    assert key in SavePlanner._cached_all_plans  # DCP's plan cache, under this checkpointer's key
    assert other._plans._key != key  # two checkpointers in one process never share plans
    ck.save(2, state_at(2), blocking=False)  # same structure: the cached plan
    ck.wait()
    changed = state_at(3)
    changed["model"]["w"] = torch.full((32, 80), 3.0)  # same count of tensors, another shape
    changed["model"]["new"] = torch.arange(7.0)
    ck.save(3, changed, blocking=True)

    into = blank()
    into["model"]["w"], into["model"]["new"] = torch.zeros(32, 80), torch.zeros(7)
    result = make(tmp_path).load_latest(into)
    assert result is not None and result.info.step == 3
    assert torch.equal(into["model"]["w"], changed["model"]["w"])
    assert torch.equal(into["model"]["new"], changed["model"]["new"])
    assert into["progress"]["tag"] == "s3"
    ck.close()
    assert key not in SavePlanner._cached_all_plans  # closed: its plans are dropped
    other.close()


def test_extra_must_be_json(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="not JSON-serializable"):
        make(tmp_path).save(1, state_at(1), blocking=True, extra={"x": object()})


def test_load_skips_truncated_and_altered_checkpoints_and_reports_them(tmp_path: Path) -> None:
    ck = make(tmp_path)
    for step in (10, 20, 30):
        ck.save(step, state_at(step), blocking=True)
    data30 = tmp_path / "ckpt" / "step_000030" / "__0_0.distcp"
    data30.write_bytes(data30.read_bytes()[:-100])  # truncated
    data20 = tmp_path / "ckpt" / "step_000020" / "__0_0.distcp"
    raw = bytearray(data20.read_bytes())
    raw[-10] ^= 0xFF  # altered in place, same size
    data20.write_bytes(bytes(raw))

    into = blank()
    result = make(tmp_path).load_latest(into)
    assert result is not None and result.info.step == 10
    assert float(into["model"]["w"][0, 0]) == 10.0
    size = (tmp_path / "ckpt" / "step_000030.corrupt" / "__0_0.distcp").stat().st_size
    assert [(p.name, reason) for p, reason in result.skipped] == [
        ("step_000030", f"file __0_0.distcp is {size} bytes, manifest says {size + 100} (truncated?)"),
        ("step_000020", "sha256 mismatch in __0_0.distcp (altered after it was written)"),
    ]
    reported = events(tmp_path, CHECKPOINT_INVALID)
    assert [Path(e["path"]).name for e in reported] == ["step_000030", "step_000020"]
    assert reported[0]["reason"] == result.skipped[0][1]
    # Moved aside, so that the run saves those steps again when it recomputes them.
    names = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert names == ["step_000010", "step_000020.corrupt", "step_000030.corrupt"]
    assert [Path(e["moved_to"]).name for e in reported] == ["step_000030.corrupt", "step_000020.corrupt"]


def test_leftover_temporary_directories_are_reported_once_and_removed(tmp_path: Path) -> None:
    ck = make(tmp_path)
    ck.save(1, state_at(1), blocking=True)
    (tmp_path / "ckpt" / ".step_000002.tmp-0123abcd").mkdir()
    (tmp_path / "ckpt" / ".step_000002.tmp-0123abcd" / "__0_0.distcp").write_bytes(b"partial")
    (tmp_path / "ckpt" / ".step_000000.del-00ff").mkdir()

    result = make(tmp_path).load_latest(blank())
    assert result is not None and result.info.step == 1
    ((path, reason),) = result.skipped
    assert path.name == ".step_000002.tmp-0123abcd" and "never published" in reason
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step_000001"]
    second = make(tmp_path).load_latest(blank())
    assert second is not None and second.skipped == []
    assert len(events(tmp_path, CHECKPOINT_INVALID)) == 1


def test_no_checkpoint_means_none(tmp_path: Path) -> None:
    assert make(tmp_path).load_latest(blank()) is None


def test_a_different_model_shape_is_refused_in_one_line(tmp_path: Path) -> None:
    make(tmp_path).save(120, state_at(120), blocking=True)
    with pytest.raises(CheckpointError) as err:
        make(tmp_path, model_hash="model-b").load_latest(blank())
    text = str(err.value)
    assert "\n" not in text
    assert text.startswith("checkpoint step_000120 was written for a different model shape")
    assert text.endswith("start a new run or restore the old model config")


def test_rank_local_keys_may_be_missing_or_extra_other_keys_may_not(tmp_path: Path) -> None:
    # Saved by a "world" whose rank-local entries are rank1 and rank2 (fake names in one process).
    saved = state_at(7)
    saved[RANK_LOCAL] = {"rank1": {"buf": torch.ones(3)}, "rank2": {"buf": torch.ones(3)}}
    make(tmp_path).save(7, saved, blocking=True)

    into = blank()
    fresh = into[RANK_LOCAL]["rank0"]["torch_rng"].clone()
    result = make(tmp_path).load_latest(into)
    assert result is not None and result.ranks_without_rank_local == [0]
    assert torch.equal(into[RANK_LOCAL]["rank0"]["torch_rng"], fresh)  # kept, not clobbered
    assert float(into["model"]["w"][0, 0]) == 7.0

    needs_more = blank()
    needs_more["extra"] = {"w": torch.zeros(3)}
    with pytest.raises(CheckpointError, match=r"lacks 1 key\(s\) this trainer needs: extra\.w"):
        make(tmp_path).load_latest(needs_more)
    # The EMA is optional: a checkpoint without one loads, and says so.
    with_ema = blank()
    with_ema["ema"] = {"w": torch.zeros(3)}
    loaded = make(tmp_path).load_latest(with_ema)
    assert loaded is not None and "ema" not in loaded.saved_sections and "model" in loaded.saved_sections


def test_constructor_refuses_a_world_without_torch_distributed(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="not initialized"):
        make(tmp_path, rank=1, world_size=2)
    with pytest.raises(CheckpointError, match="keep_last"):
        make(tmp_path, keep_last=0)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness is Linux's")
def test_a_background_save_runs_below_training_priority_and_a_blocking_one_does_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[tuple[str, int]] = []
    write = writing_mod.SaveWriter._dcp_save

    def spy(self: writing_mod.SaveWriter, job: Any, state: dict[str, Any], attrs: dict[str, Any]) -> None:
        tid = threading.get_native_id()
        seen.append((threading.current_thread().name, os.getpriority(os.PRIO_PROCESS, tid)))
        write(self, job, state, attrs)

    monkeypatch.setattr(writing_mod.SaveWriter, "_dcp_save", spy)
    base = os.getpriority(os.PRIO_PROCESS, os.getpid())
    ck = make(tmp_path, writer="thread", writer_nice=7)
    ck.save(1, state_at(1), blocking=False)
    ck.wait()
    ck.save(2, state_at(2), blocking=True)
    ck.close()
    assert seen[0][0].startswith("hpclaunch-ckpt") and seen[0][1] == min(19, base + 7), seen
    assert seen[1] == (threading.main_thread().name, base), seen
    assert os.getpriority(os.PRIO_PROCESS, os.getpid()) == base  # training's own thread untouched
    assert [e["step"] for e in events(tmp_path, CHECKPOINT_SAVED)] == [1, 2]


def test_several_write_threads_write_several_files_all_in_the_manifest_and_load_back(tmp_path: Path) -> None:
    ck = make(tmp_path, write_threads=3)
    saved = state_at(7)
    ck.save(7, saved, blocking=True)
    path = tmp_path / "ckpt" / "step_000007"
    data = sorted(p.name for p in path.glob("*.distcp"))
    assert len(data) == 3  # one file per thread
    manifest = json.loads((path / MANIFEST_NAME).read_text())
    for name in data:
        assert file_digest(path / name) == (
            manifest["files"][name]["bytes"],
            manifest["files"][name]["sha256"],
        )
    into = blank()
    result = make(tmp_path).load_latest(into)  # read with the default, one thread
    assert result is not None and result.info.step == 7
    assert torch.equal(into["model"]["w"], saved["model"]["w"]) and into["sched"] == saved["sched"]
    (path / data[1]).write_bytes(b"not what was hashed")
    assert make(tmp_path).load_latest(blank()) is None  # a damaged thread's file fails the checkpoint


def test_auto_write_threads_give_each_rank_its_share_of_the_cores() -> None:
    from hpclaunch.rank.checkpoint.writing import MAX_AUTO_WRITE_THREADS, resolve_write_threads

    assert resolve_write_threads("auto", 8, cores=96) == MAX_AUTO_WRITE_THREADS
    assert resolve_write_threads("auto", 8, cores=32) == 4
    assert resolve_write_threads("auto", 2, cores=2) == 1  # this development box: as before
    assert resolve_write_threads("auto", 4, cores=2) == 1
    assert resolve_write_threads(3, 8, cores=2) == 3  # a number is kept
