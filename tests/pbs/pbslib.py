"""Helpers for whole hpclaunch runs on the real OpenPBS: the CLI runs as the job user (see conftest)."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil
from tests.runlib import TINY, kill_together, tiny_overrides, wait_ended, wait_for

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


def kill_job_on(node: str, job_id: str, *, python_only: bool = False) -> list[str]:
    """Every process of PBS job ``job_id`` on ``node`` but PBS's own (pbs_mom): the job script,
    the launcher, the agent and everything under it (``python_only``: the agent and what it started;
    the job script and the launcher live on)."""
    ns = f"hpclpbs{node.removeprefix('pbsn')}"
    pids = os.popen(f"ip netns pids {ns}").read().split()
    mine = f"PBS_JOBID={job_id}".encode()
    found = []
    for pid in map(int, pids):
        try:
            cmd = " ".join(psutil.Process(pid).cmdline())
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except (psutil.Error, OSError):
            continue
        if "pbs_mom" in cmd or mine not in env or (python_only and "python" not in cmd.split(" ")[0]):
            continue
        found.append((pid, cmd[:80]))
    return kill_together(found)
