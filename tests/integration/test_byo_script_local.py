"""Bring your own trainer, for real on this machine: the example GPT script (examples/byo), written
only against ``hpclaunch.attach``/``run.steps``, run standalone under plain torchrun and stopped by
SIGTERM; submitted to the embedded local scheduler with a short time limit (stopped and requeued
several times) while a rank is killed once and restarted in place from the memory tier; each
against the same script run uninterrupted, bitwise."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from tests.runlib import (
    ROOT,
    checkpoint_writers,
    events,
    final_params_sha,
    hpclaunch,
    rank_process,
    wait_for,
    wait_run_done,
)

pytestmark = pytest.mark.slow

DDP = ROOT / "examples" / "byo" / "gpt_ddp.py"
SMALL = ["--batch", "4", "--block", "16", "--layers", "1", "--d-model", "32", "--workers", "1"]


def _losses(run: Path) -> dict[int, Any]:
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {int(x["step"]): x["loss"] for x in lines}


def _torchrun(cwd: Path, run_dir: Path, *args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "HPCLAUNCH_RUN_DIR": str(run_dir), "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        str(DDP),
        *SMALL,
        *args,
    ]
    return subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def test_a_script_under_plain_torchrun_stopped_by_sigterm_resumes_bitwise(tmp_path: Path) -> None:
    """No hpclaunch job: attach keeps the run's directory itself; torchrun passes a SIGTERM to its
    workers, every rank stops after the same step with a save (exit 5: preempted), and the same
    command run again resumes and ends where an uninterrupted run ends, bit for bit."""
    ref, cut = tmp_path / "ref", tmp_path / "cut"
    ref.mkdir(), cut.mkdir()
    done = _torchrun(ref, ref / "run", "--steps", "40")
    assert done.wait(timeout=600) == 0, done.stdout.read() if done.stdout else ""
    first = _torchrun(cut, cut / "run", "--steps", "40", "--sleep", "0.5")
    wait_for(lambda: (cut / "run" / "metrics.jsonl").exists(), timeout=300, what="the first logged step")
    first.send_signal(signal.SIGTERM)
    out, _ = first.communicate(timeout=300)
    assert "stopped after step" in out and "(preemption); the state after it is saved" in out, out[-2000:]
    stopped = int(out.split("stopped after step ")[1].split()[0])
    assert 0 < stopped < 40
    again = _torchrun(cut, cut / "run", "--steps", "40")
    out, _ = again.communicate(timeout=600)
    assert again.returncode == 0, out[-2000:]
    assert _losses(cut / "run") == _losses(ref / "run")
    a = torch.load(ref / "gpt_ddp.pt", weights_only=True)
    b = torch.load(cut / "gpt_ddp.pt", weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # once more: nothing left to train, and it says so (it restored and exited 0 without a word)
    done = _torchrun(ref, ref / "run", "--steps", "40")
    out, _ = done.communicate(timeout=600)
    assert done.returncode == 0 and "nothing to train: the run is at step 40 of 40" in out, out[-2000:]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The script trained uninterrupted with ``hpclaunch train --script`` (2 gloo ranks)."""
    work = tmp_path_factory.mktemp("byo-ref")
    sets = ["--set", "name=ref", "--set", "scheduler.procs_per_node=2"]
    hpclaunch("train", "--script", str(DDP), *sets, "--", *SMALL, *STEPS, cwd=work, timeout=900)
    return work / "runs" / "ref"


# 120 steps x 0.5 s of sleep: at least three attempts of a 30 s limit on any machine
STEPS = ["--steps", "120"]


def _submit(work: Path, name: str, *sets: str) -> Path:
    args = [a for s in ("scheduler.procs_per_node=2", f"name={name}", *sets) for a in ("--set", s)]
    hpclaunch("submit", "--script", str(DDP), *args, "--no-preflight", "--", *SMALL, *STEPS, cwd=work)
    return work / "runs" / name


# (On CI's two busy cores an attempt's start-up took 13-36 s: with 30 s limits the run made a step
# or two an attempt and spent its 20 requeues before step 120.)
@pytest.mark.timeout(1500)
def test_a_script_stopped_at_each_time_limit_is_requeued_and_ends_bitwise(
    tmp_path: Path, reference: Path
) -> None:
    """The local scheduler's time limit stops the run again and again (every rank after the same
    step, a save, a requeue) until it ends, bitwise equal to the uninterrupted run; its status says
    step/total and goodput. 40 s limits, 72 s of training: three attempts or more however fast an
    attempt starts; requeues enough that a loaded machine, whose attempts start slowly, gets to the end."""
    run = _submit(
        tmp_path, "limited", "scheduler.time_limit=40s", "launch.stop_margin_s=3", "testing.step_sleep_s=0.6",
        "scheduler.max_requeues=60",
    )  # fmt: skip
    # Each rank's writer was forked before the script ran (with the rank's imports), not started to
    # import torch itself (~2 core-s a rank, every attempt): its command line is the rank host's.
    writers = wait_for(
        lambda: checkpoint_writers(run / "checkpoints"), timeout=600, poll=0.2, what="a writer"
    )
    for pid in writers:
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):  # (an attempt may have ended)
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            assert b"hpclaunch.rank.checkpoint.writer_main" not in cmdline, cmdline
    s = wait_run_done(run, tmp_path, timeout=1400)
    assert s["state"] == "finished", json.dumps(s, indent=1)[-3000:]
    ends = [(a["end"], a["cause"]) for a in s["attempts"]]
    assert ends.count(("requeued", "timeout")) >= 2 and ends[-1] == ("finished", None), ends
    assert (s["step"], s["steps"]) == (120, 120) and 0 < s["time"]["goodput"] < 1
    assert final_params_sha(run) == final_params_sha(reference)
    assert _losses(run) == _losses(reference)


def test_a_scripts_rank_killed_once_restarts_in_place_from_the_memory_tier_bitwise(
    tmp_path: Path, reference: Path
) -> None:
    """A rank killed mid-run: the node agent restarts the attempt in place, the script runs again
    from the top and attach restores the newest snapshot from the node's memory; the run ends
    bitwise equal to the uninterrupted one."""
    run = _submit(
        tmp_path, "crashed", "testing.step_sleep_s=0.25", "checkpoint.every_steps=50",
        "checkpoint.memory.every_steps=2", f"checkpoint.memory.dir={tmp_path}", "scheduler.max_failure_retries=1",
    )  # fmt: skip
    wait_for(
        lambda: any(e["event"] == "snapshot_saved" and e.get("step", 0) >= 14 for e in events(run)),
        timeout=300,
        poll=0.2,
        what="a snapshot at step 14 or later",
    )
    rank_process(run, 1).send_signal(signal.SIGKILL)
    s = wait_run_done(run, tmp_path, timeout=900)
    assert s["state"] == "finished", json.dumps(s, indent=1)[-3000:]
    first, second = s["attempts"][:2]
    assert (first["end"], first["cause"]) == ("restarted in place", "crash") and second["in_place"], first
    assert second["resumed_from"] == "memory" and second["resumed_step"] >= 14, second
    assert final_params_sha(run) == final_params_sha(reference)
    assert _losses(run) == _losses(reference)
