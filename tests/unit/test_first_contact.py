"""What a new user meets first (issue 46, items 10 and 11): a run that is not there named like every
other command names it, an empty config refused, a sweep's root without a run's empty folders, and
a memory tier whose tmpfs does not exist failing preflight where the run runs on this machine."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpclaunch.cli import main
from hpclaunch.config import load_config
from hpclaunch.orchestrator.launch import prepare, write_run_dir
from hpclaunch.preflight import Status
from hpclaunch.preflight.check_context import CheckContext
from hpclaunch.preflight.layout import check_config
from hpclaunch.preflight.probe import StaticProbe

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parents[2]


def test_train_resume_of_a_run_that_is_not_there_says_so_as_status_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["train", "runs/nope", "--resume"]) == 2
    train_err = capsys.readouterr().err
    assert main(["status", "runs/nope"]) == 2
    status_err = capsys.readouterr().err
    assert f"RUN: {tmp_path}/runs/nope does not exist" in train_err
    assert train_err == status_err and "config file not found" not in train_err


@pytest.mark.parametrize("text", ["", "\n", "# all commented out\n# name: x\n"])
def test_an_empty_config_is_refused_in_one_line(
    text: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty.yaml").write_text(text)
    assert main(["preflight", "empty.yaml", "--no-estimate"]) == 2
    err = capsys.readouterr().err
    assert "empty.yaml: holds no settings (it is empty, or only comments)" in err
    assert not (tmp_path / "runs").exists()


def test_a_sweeps_root_holds_no_empty_run_folders(tmp_path: Path) -> None:
    cfg = load_config(ROOT / "examples/tiny.yaml", [f"run_dir={tmp_path / 'sweep'}"], base=ROOT)
    prepared = prepare(cfg, sweeps=["train.lr=1e-4,3e-4"])
    paths = write_run_dir(cfg, prepared.plan, prepared.rendered)
    there = sorted(p.name for p in paths.root.iterdir())
    assert there == ["config.yaml", "job.local.sh", "logs", "plan.json", "scheduler"], there


def test_a_missing_memory_tier_tmpfs_fails_where_the_run_runs_here(tmp_path: Path) -> None:
    missing = ["checkpoint.memory.every_steps=5", f"checkpoint.memory.dir={tmp_path / 'missing' / 'shm'}"]
    local = load_config(ROOT / "examples/tiny.yaml", missing, base=ROOT)
    out = check_config(CheckContext(cfg=local, node=None, probe=StaticProbe(None)))
    assert out.status is Status.FAIL
    assert "does not exist, and the run runs on this machine" in out.finding
    elsewhere = load_config(ROOT / "examples/tiny.yaml", [*missing, "scheduler.kind=slurm"], base=ROOT)
    out = check_config(CheckContext(cfg=elsewhere, node=None, probe=StaticProbe(None)))
    assert out.status is not Status.FAIL and "not checked here (the nodes' tmpfs)" in out.finding


def test_the_charliecloud_image_hint_names_what_debians_runtime_can_use() -> None:
    """Debian's charliecloud-runtime ships ch-run alone: the hint named ch-image and ch-convert."""
    from hpclaunch.preflight.container_check import BUILD

    assert "ch-image" not in BUILD["charliecloud"] and "ch-convert" not in BUILD["charliecloud"]
    assert "root filesystem directory" in BUILD["charliecloud"] and "tar -x -C" in BUILD["charliecloud"]
