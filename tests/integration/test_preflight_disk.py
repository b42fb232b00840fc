"""Not enough disk, and none writable, for real: the run directory on a 1 MiB or a read-only tmpfs
(needs root to mount)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from hpclaunch.config import RunConfig
from hpclaunch.preflight import Status, run_login_checks
from hpclaunch.preflight.probe import StaticProbe
from hpclaunch.shards import synth_dataset

ROOT = Path(__file__).parents[2]


@contextmanager
def tmpfs(mnt: Path, options: str) -> Iterator[Path]:
    """A tmpfs mounted at ``mnt`` with ``options`` for the block (skipped where it cannot be)."""
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    res = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mnt)], capture_output=True, text=True
    )
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


@pytest.fixture
def tiny_fs(tmp_path: Path) -> Iterator[Path]:
    with tmpfs(tmp_path / "small", "size=1m") as mnt:
        yield mnt


def test_run_dir_on_a_full_filesystem(tiny_fs: Path) -> None:
    cfg = RunConfig.model_validate(
        {"name": "t", "run_dir": str(tiny_fs / "runs" / "t"), "preflight": {"min_free_disk_gb": 0}}
    )
    # the exact parameter count needs the probe (seconds); the formula gives the same number
    report = run_login_checks(cfg, only={"disk"}, probe=StaticProbe(None))
    disk = report.get("disk")
    assert disk.status is Status.FAIL
    assert f"{tiny_fs}/runs/t (at {tiny_fs})" in disk.finding
    assert "1.0 MiB free, needs 15.1 MiB (3 checkpoints x 5.0 MiB (estimated))" in disk.finding
    assert disk.hint and "keep_last" in disk.hint


def test_inodes_count_too(tiny_fs: Path) -> None:
    # fill the inode table of a tmpfs limited to 64 inodes; space is plentiful
    subprocess.run(["mount", "-o", "remount,size=64m,nr_inodes=64", str(tiny_fs)], check=True)
    for i in range(60):
        (tiny_fs / f"f{i}").touch()
    cfg = RunConfig.model_validate(
        {"name": "t", "run_dir": str(tiny_fs / "r"), "preflight": {"min_free_disk_gb": 0}}
    )
    disk = run_login_checks(cfg, only={"disk"}, probe=StaticProbe(None)).get("disk")
    assert disk.status is Status.FAIL and "inodes free, needs" in disk.finding


def test_a_read_only_run_dir_fails_preflight_and_every_writing_command_in_one_line(tmp_path: Path) -> None:
    """A read-only filesystem, for real: preflight's disk check says so (it passed: free space), and
    a command that must write there says it in one line, exit 2, no traceback (it was an OSError's)."""
    model = RunConfig.model_validate({}).model
    synth_dataset(tmp_path / "data", samples=32, seed=0, model_cfg=model)
    sets = [
        "--set",
        f"data.token_dir={tmp_path / 'data' / 'tokens'}",
        "--set",
        f"data.latent_dir={tmp_path / 'data' / 'latents'}",
    ]
    with tmpfs(tmp_path / "ro", "ro,size=1m") as ro:
        cfg = RunConfig.model_validate(
            {"name": "t", "run_dir": str(ro / "runs" / "t"), "preflight": {"min_free_disk_gb": 0}}
        )
        disk = run_login_checks(cfg, only={"disk"}, probe=StaticProbe(None)).get("disk")
        assert disk.status is Status.FAIL and "cannot be written (a read-only filesystem)" in disk.finding, (
            disk
        )
        for argv in (
            ["init", str(ro / "my.yaml")],
            ["train", str(ROOT / "examples" / "tiny.yaml"), *sets, "--set", f"run_dir={ro / 'runs' / 't'}"],
        ):
            done = subprocess.run(
                [sys.executable, "-m", "hpclaunch", *argv],
                capture_output=True,
                text=True,
                cwd=tmp_path,
                timeout=300,
            )
            lines = done.stderr.strip().splitlines()
            assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
            assert (
                lines[0].startswith("hpclaunch: error: ")
                and "cannot write here: Read-only file system" in lines[0]
            ), lines
