"""Checkpoint faults with real DCP in one process: corrupt checkpoints are moved aside and saved
again, retention counts only valid ones, a full disk or a denied path is said in the user's words,
and a background save that fails is acted on at the next step, not at the end of the run.

Disk full is real where the test may mount a small tmpfs (root); everywhere, the same failure is
also injected as ENOSPC through DCP's filesystem writer (the tests' names say which is which).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from tests.unit.checkpointers import checkpointer as flat_checkpointer
from tests.unit.tiny_model import tiny_model

from hpclaunch.config import load_config
from hpclaunch.errors import CheckpointError
from hpclaunch.fsutil import read_jsonl
from hpclaunch.rank.checkpoint import ENV_FAIL, Checkpointer, step_dir_name
from hpclaunch.rundir import (
    CHECKPOINT_FAILED,
    CHECKPOINT_INVALID,
    CHECKPOINT_SAVED,
    Ledger,
    RunPaths,
    read_events,
)
from hpclaunch.shards import synth_dataset
from hpclaunch.trainer.entry import main


def make(run: Path, **kw: Any) -> Checkpointer:
    args: dict[str, Any] = {
        "rank": 0,
        "world_size": 1,
        "config_hash": "cfg",
        "model_hash": "m",
        "keep_last": 10,
        "ledger": Ledger(RunPaths(run), role="trainer"),
    }
    args.update(kw)
    return flat_checkpointer(run / "ckpt", **args)


def state(step: int, mib: float = 0.25) -> dict[str, Any]:
    n = int(mib * (1 << 20) / 4)
    return {"model": {"w": torch.full((n,), float(step))}, "train": {"step": torch.tensor(step)}}


def events(run: Path, name: str) -> list[dict[str, Any]]:
    return [e.record for e in read_events(RunPaths(run)).events if e.event == name]


def corrupt(path: Path) -> None:
    """Flip one byte of the data file in place (same size: only the sha256 can tell)."""
    data = path / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))


def test_a_corrupt_checkpoint_is_moved_aside_and_saved_again_when_its_step_is_recomputed(
    tmp_path: Path,
) -> None:
    ck = make(tmp_path)
    ck.save(10, state(10), blocking=True)
    ck.save(20, state(20), blocking=True)
    corrupt(tmp_path / "ckpt" / step_dir_name(20))

    resumed = make(tmp_path)
    result = resumed.load_latest(state(0))
    assert result is not None and result.info.step == 10
    (invalid,) = events(tmp_path, CHECKPOINT_INVALID)
    assert invalid["reason"] == "sha256 mismatch in __0_0.distcp (altered after it was written)"
    assert invalid["moved_to"] == str(tmp_path / "ckpt" / "step_000020.corrupt")

    resumed.save(20, state(20), blocking=True)  # the run recomputed step 20: saved again, not skipped
    names = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert names == ["step_000010", "step_000020", "step_000020.corrupt"]
    assert [i.step for i in resumed.list_valid()] == [10, 20]
    assert [e["step"] for e in events(tmp_path, CHECKPOINT_SAVED)] == [10, 20, 20]


def test_retention_never_counts_an_invalid_checkpoint_among_those_it_keeps(tmp_path: Path) -> None:
    ck = make(tmp_path, keep_last=2)
    ck.save(1, state(1), blocking=True)
    ck.save(2, state(2), blocking=True)
    corrupt(tmp_path / "ckpt" / step_dir_name(2))
    later = make(tmp_path, keep_last=2)  # another attempt: knows nothing of step 2 yet
    later.save(3, state(3), blocking=True)
    # Keeping "the last two" must mean two good ones: 1 and 3, not the corrupt 2 in place of 1.
    assert [i.step for i in later.list_valid()] == [1, 3]
    assert (tmp_path / "ckpt" / "step_000002.corrupt").is_dir()
    (invalid,) = events(tmp_path, CHECKPOINT_INVALID)
    assert invalid["reason"].startswith("sha256 mismatch")


@contextlib.contextmanager
def small_tmpfs(where: Path, size: str) -> Iterator[Path]:
    where.mkdir(parents=True)
    try:
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
            check=True,
            capture_output=True,
        )
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"cannot mount a tmpfs here ({e}); the injected-ENOSPC test covers this")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False, capture_output=True)


def test_disk_full_on_a_real_small_tmpfs_names_the_path_the_free_space_and_the_size_needed(
    tmp_path: Path,
) -> None:
    with small_tmpfs(tmp_path / "ckpt", "1m") as directory:
        ck = make(tmp_path)
        with pytest.raises(CheckpointError) as err:
            ck.save(7, state(7, mib=4), blocking=True)
        text = err.value.one_line()
        # 1 MiB tmpfs: once the half-written save is removed, all of it is free again.
        assert (
            text
            == f"no space left on {directory}: 1.0 MiB free, the checkpoint needs about 4.0 MiB (saving step 7)"
        )
        assert "\n" not in text and err.value.hint and "checkpoint.dir" in err.value.hint
        assert list(directory.iterdir()) == []  # the half-written save is gone: the space is free again
        ck.save(8, state(8, mib=0.1), blocking=True)  # and a smaller one fits
        assert [i.step for i in ck.list_valid()] == [8]


def test_disk_full_injected_enospc_through_the_filesystem_writer_says_it_in_the_users_words(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_FAIL, "ENOSPC@3")
    ck = make(tmp_path)
    with pytest.raises(
        CheckpointError,
        match=r"^no space left on .*/ckpt: .* free, the checkpoint needs about 256\.0 KiB \(saving step 3\)$",
    ):
        ck.save(3, state(3), blocking=True)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == []


def test_permission_denied_injected_eacces_through_the_filesystem_writer_names_the_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # (root ignores directory permissions, so the OS error is injected where DCP writes.)
    monkeypatch.setenv(ENV_FAIL, "EACCES@5")
    with pytest.raises(
        CheckpointError,
        match=r"^permission denied: cannot write .*/ckpt/\.step_000005\.tmp-[0-9a-f]+ \(saving step 5\)$",
    ) as err:
        make(tmp_path).save(5, state(5), blocking=True)
    assert err.value.hint is not None and "writable" in err.value.hint


# ---- the trainer acts on a failed background save at the next step --------------------------------

MODEL = tiny_model(1)

pytestmark = pytest.mark.usefixtures("in_process_trainer")


def trainer_run(tmp_path: Path, writer: str = "process") -> Path:
    data = tmp_path / "data"
    synth_dataset(data, samples=128, seed=0, model_cfg=load_config(None, MODEL).model)
    cfg = load_config(
        None,
        [
            *MODEL,
            "scheduler.procs_per_node=1",
            "train.steps=24",
            "train.global_batch=8",
            "train.log_every=1",
            "checkpoint.every_steps=8",
            f"checkpoint.writer={writer}",
            "data.num_workers=0",
            "preflight.distributed_smoke=false",
            f"data.token_dir={data / 'tokens'}",
            f"data.latent_dir={data / 'latents'}",
        ],
        base=tmp_path,
    )
    run = RunPaths(tmp_path / "run").ensure()
    run.config.write_text(cfg.to_yaml())
    return run.root


WRITERS = pytest.mark.parametrize("writer", ["process", "thread"])


@WRITERS
def test_a_failed_background_save_is_saved_again_at_the_next_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, writer: str
) -> None:
    run = trainer_run(tmp_path, writer)
    monkeypatch.setenv(ENV_FAIL, "ENOSPC@8")  # the background save of step 8 fails, once
    assert main([str(run)]) == 0
    (failed,) = events(run, CHECKPOINT_FAILED)
    # Acted on at the first step after the failure was known (all ranks agree on that step), and
    # at the latest by the next periodic save, which waits for it: never at the end of the run.
    assert 9 <= failed["step"] <= 16 and failed["action"] == "blocking retry"
    assert failed["error"].startswith("no space left on ")
    saved = [(e["step"], e["blocking"]) for e in events(run, CHECKPOINT_SAVED)]
    assert saved[0] == (failed["step"], True)  # saved at once, blocking: no step left unprotected
    assert [s for s, _ in saved] == sorted({failed["step"], 16, 24})


@WRITERS
def test_a_background_save_that_keeps_failing_stops_the_run_at_the_next_step_with_the_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], writer: str
) -> None:
    run = trainer_run(tmp_path, writer)
    monkeypatch.setenv(ENV_FAIL, "ENOSPC@8+")  # the disk stays full
    assert main([str(run)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hpclaunch: training failed: checkpoint failed twice")
    assert "no space left on " in err[0] and "the checkpoint needs about" in err[0]
    outcome = json.loads(RunPaths(run).outcome_file("local").read_text())
    assert outcome["status"] == "failed" and 9 <= outcome["step"] <= 16  # right away, not at step 24
    assert outcome["error"] == err[0].removeprefix("hpclaunch: training failed: ")
    assert read_jsonl(RunPaths(run).metrics)[-1]["step"] == outcome["step"]


def test_the_kill_hook_names_one_save_or_the_first_from_a_step_on(monkeypatch: pytest.MonkeyPatch) -> None:
    from hpclaunch.rank.checkpoint.fault_hooks import ENV_KILL, kill_requested

    monkeypatch.setenv(ENV_KILL, "35:0:data:writer")
    assert kill_requested(35, 0, "data") and not kill_requested(45, 0, "data")
    monkeypatch.setenv(ENV_KILL, ">=35:0:data")
    assert kill_requested(35, 0, "data") and kill_requested(45, 0, "data")
    assert not kill_requested(30, 0, "data") and not kill_requested(45, 1, "data")
    assert not kill_requested(45, 0, "publish")


def test_the_error_words_hold_no_test_hook() -> None:
    """``save_errors`` says real failures in the user's words; the hooks that make saves fail on
    purpose are ``fault_hooks``'s, and production modules take them from there."""
    from hpclaunch.rank.checkpoint import fault_hooks, save_errors

    hooks = {"delay_write_hook", "kill_requested", "kill_hook", "injected_failure", "hooked_writer_class"}
    hooks |= {
        "snapshot_copy_delay_hook",
        "ENV_DELAY_WRITE",
        "ENV_KILL",
        "ENV_FAIL",
        "ENV_SNAPSHOT_DELAY_COPY",
    }
    assert hooks <= set(vars(fault_hooks))
    assert not hooks & set(vars(save_errors))
    assert "HPCLAUNCH_TEST" not in Path(save_errors.__file__).read_text()
