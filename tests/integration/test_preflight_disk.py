"""Not enough disk, for real: the run directory on a 1 MiB tmpfs (needs root to mount)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from hpclaunch.config import RunConfig
from hpclaunch.preflight import Status, run_login_checks
from hpclaunch.preflight.probe import StaticProbe


@pytest.fixture
def tiny_fs(tmp_path: Path) -> Iterator[Path]:
    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    res = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True, text=True
    )
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


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
