"""CLI commands that do not train never import torch (they must feel instant)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def imported_modules(args: list[str], cwd: Path) -> tuple[set[str], subprocess.CompletedProcess[str]]:
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "hpclaunch", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
    )
    modules = set()
    for line in result.stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            modules.add(line.rsplit("|", 1)[1].strip())
    return modules, result


@pytest.mark.parametrize(
    "args",
    [
        ["render", "examples/slurm-8xh100.yaml"],
        ["render", "examples/pbs-pro.yaml", "--pbs-dialect", "torque"],
        ["config", "show", "examples/tiny.yaml"],
        ["config", "schema"],
        ["--help"],
    ],
    ids=lambda a: "-".join(a[:2]),
)
def test_command_does_not_import_torch(args: list[str]) -> None:
    modules, result = imported_modules(args, ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    torch_like = sorted(m for m in modules if m == "torch" or m.startswith(("torch.", "mmdit", "numpy")))
    assert torch_like == [], f"{args} imported {torch_like[:5]}"


def test_status_does_not_import_torch(tmp_path: Path) -> None:
    run = tmp_path / "runs" / "x"
    run.mkdir(parents=True)
    (run / "events.jsonl").write_text('{"event": "submitted", "job_id": "1", "ts": 1}\n')
    (run / "plan.json").write_text("{}")
    modules, result = imported_modules(["status", str(run), "--json"], tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert not any(m == "torch" or m.startswith("torch.") for m in modules)


def test_stop_and_logs_do_not_import_torch(tmp_path: Path) -> None:
    run = tmp_path / "runs" / "x"
    (run / "logs" / "attempt-1.0").mkdir(parents=True)
    (run / "logs" / "attempt-1.0" / "node0.log").write_text("step 1/10 loss 1.0\n")
    (run / "events.jsonl").write_text('{"event": "submitted", "job_id": "1", "ts": 1}\n')
    for args in (["stop", str(run)], ["logs", str(run)]):
        modules, result = imported_modules(args, tmp_path)
        assert result.returncode == 0, result.stderr[-2000:]
        assert not any(m == "torch" or m.startswith("torch.") for m in modules), args
