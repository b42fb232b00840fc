"""Helpers for whole hpclaunch runs on the real OpenPBS: the CLI runs as the job user (see conftest)."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tests.runlib import TINY, tiny_overrides, wait_ended, wait_for

if TYPE_CHECKING:
    from tests.pbs.conftest import PbsServer

ACTIVE = (
    "pending",
    "running",
    "requeued",
    "held",
    "suspended",
    "stopping",
    "finishing",
    "failing",
    "cancelling",
)


def synth_data(server: PbsServer, directory: Path, samples: int = 512) -> Path:
    if not (directory / "tokens").exists():
        server.hpclaunch(
            "data", "synth", str(directory), "--samples", str(samples), "--seed", "0", cwd=directory.parent
        )
    return directory


def submit(
    server: PbsServer,
    work: Path,
    data: Path,
    name: str,
    *extra: str,
    sweep: str = "",
    env: dict[str, str] | None = None,
) -> Path:
    args = ["submit", str(TINY), *tiny_overrides(work, data, name, "scheduler.kind=pbs", *extra)]
    if sweep:
        args += ["--sweep", sweep]
    server.hpclaunch(*args, "--no-preflight", cwd=work, env=env)
    return work / "runs" / name


def start_train(server: PbsServer, work: Path, data: Path, name: str, *extra: str) -> subprocess.Popen[str]:
    """`hpclaunch train` in the background, as the job user (the uninterrupted reference)."""
    argv = [
        "runuser",
        "-u",
        server.user,
        "--",
        "/usr/bin/env",
        "-i",
        *(f"{k}={v}" for k, v in server.env.items()),
        server.python,
        "-m",
        "hpclaunch",
        "train",
        str(TINY),
        *tiny_overrides(work, data, name, *extra),
    ]
    return subprocess.Popen(argv, cwd=work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish_train(proc: subprocess.Popen[str], timeout: float = 300) -> None:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"hpclaunch train exited {proc.returncode}\n{out[-3000:]}"


def status(server: PbsServer, run: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(server.hpclaunch("status", str(run), "--json", cwd=run.parent).stdout)
    return data


def wait_run_done(server: PbsServer, run: Path, timeout: float) -> dict[str, Any]:
    """Until neither the ledger nor PBS has the run in flight; returns `status --json`."""
    return wait_ended(lambda: status(server, run), run, timeout=timeout, poll=1.0, active=ACTIVE)


def submitted_job(run: Path, events: Any) -> str:
    return str(
        wait_for(
            lambda: next((e["job_id"] for e in events(run) if e["event"] == "submitted"), None),
            timeout=30,
            what="submission",
        )
    )


def elapsed(t0: float) -> str:
    return f"{time.monotonic() - t0:.0f}s"
