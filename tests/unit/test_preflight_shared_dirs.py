"""On a cluster the job runs on other machines than the login node (issue 46, item 3): its run
directory, checkpoints and Python must be where the compute nodes see them. Preflight warns when
they are under /tmp (each node's own) or on a filesystem of this machine's own."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpclaunch.config import load_config
from hpclaunch.preflight import Status
from hpclaunch.preflight import disk as disk_check
from hpclaunch.preflight.check_context import CheckContext, Outcome
from hpclaunch.preflight.disk import check_disk, filesystem_of
from hpclaunch.preflight.probe import StaticProbe

pytestmark = pytest.mark.fast

MOUNTINFO = """\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
25 22 0:40 / /shared rw,relatime shared:2 - nfs4 fs:/export rw
26 25 0:41 / /shared/scratch rw - lustre 10.0.0.1@o2ib:/scratch rw
27 22 0:42 / /dev/shm rw - tmpfs tmpfs rw
"""


def test_the_filesystem_of_a_path_is_its_deepest_mount() -> None:
    assert filesystem_of(Path("/shared/u/runs/x"), MOUNTINFO) == (Path("/shared"), "nfs4")
    assert filesystem_of(Path("/shared/scratch/x"), MOUNTINFO) == (Path("/shared/scratch"), "lustre")
    assert filesystem_of(Path("/home/u"), MOUNTINFO) == (Path("/"), "ext4")
    assert filesystem_of(Path("/sharedfoo"), MOUNTINFO) == (Path("/"), "ext4")  # not /shared's


def disk(run_dir: Path, *sets: str, monkeypatch: pytest.MonkeyPatch, fstype: str = "nfs4") -> Outcome:
    monkeypatch.setattr(disk_check, "filesystem_of", lambda path: (Path("/shared"), fstype))
    cfg = load_config(None, [f"run_dir={run_dir}", "launch.python=/shared/venv/bin/python", *sets])
    return check_disk(CheckContext(cfg=cfg, node=None, probe=StaticProbe(None)))


def test_a_cluster_run_under_tmp_is_warned_about(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = disk(tmp_path / "runs" / "x", "scheduler.kind=slurm", "scheduler.nodes=2", monkeypatch=monkeypatch)
    assert out.status is Status.WARN
    assert f"the run directory {tmp_path}/runs/x is under /tmp, which is each node's own" in out.finding
    assert "the filesystem the login and compute nodes share" in (out.hint or "")
    # the same on this machine (the local scheduler: it is the node) says nothing of it
    local = disk(tmp_path / "runs" / "x", monkeypatch=monkeypatch)
    assert local.status is Status.PASS


def test_this_machines_own_filesystem_is_warned_about_and_a_shared_one_passes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = Path("/home/u/runs/x")  # (its nearest existing parent, /, is what is measured)
    out = disk(run, "scheduler.kind=pbs", monkeypatch=monkeypatch, fstype="ext4")
    assert out.status is Status.WARN
    assert "the run directory /home/u/runs/x is on ext4 (/shared), a filesystem of this machine's own" in (
        out.finding
    )
    shared = disk(run, "scheduler.kind=pbs", monkeypatch=monkeypatch, fstype="nfs4")
    assert shared.status is Status.PASS


def test_a_python_under_tmp_is_warned_about(monkeypatch: pytest.MonkeyPatch) -> None:
    out = disk(
        Path("/home/u/runs/x"), "scheduler.kind=slurm", "launch.python=/tmp/clone/.venv/bin/python",
        monkeypatch=monkeypatch,
    )  # fmt: skip
    assert "the job's Python /tmp/clone/.venv/bin/python is under /tmp" in out.finding
