"""Bring your own trainer on the real local SLURM, 3-node layout: the example GPT script
(examples/byo/gpt_ddp.py, DDP over gloo, a DataLoader with a worker) submitted with ``--script``.

Two runs at once, each bitwise against the same script trained uninterrupted at its world size
with ``hpclaunch train --script`` on this machine:

- on two nodes with a two-minute limit: the time limit stops every rank after the same step with a
  save, the job is requeued (``scontrol requeue``) and resumes from disk, until it finishes;
- on one training node and two spares: a rank killed is restarted in place from the memory tier's
  snapshots; a rank that hangs is found by the watchdog and its node replaced by a spare; that
  node then dies (every process of the run on it) and the other spare takes its place.

Their status says step/total, an ETA while they run, goodput and which tier each attempt resumed
from."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil
import pytest
from tests import byo_faults
from tests.byo_faults import DDP, FAULTY_STEPS, SMALL
from tests.runlib import (
    final_params_sha,
    hpclaunch,
    kill_together,
    last_logged_step,
    rank_on_node,
    status,
    wait_for,
    wait_run_done,
)

if TYPE_CHECKING:
    from tests.cluster.conftest import SlurmCluster

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

LIMITED_STEPS = 165  # x 0.8 s of sleep: longer than its two-minute limit on any machine


def _submit(work: Path, name: str, steps: int, *sets: str) -> Path:
    args = [a for s in (f"name={name}", "scheduler.kind=slurm", *sets) for a in ("--set", s)]
    hpclaunch(
        "submit", "--script", str(DDP), *args, "--no-preflight", "--", *SMALL, "--steps", str(steps), cwd=work
    )
    return work / "runs" / name


def _reference(work: Path, name: str, ranks: int, steps: int) -> str:
    sets = ["--set", f"name={name}", "--set", f"scheduler.procs_per_node={ranks}"]
    hpclaunch(
        "train", "--script", str(DDP), *sets, "--", *SMALL, "--steps", str(steps), cwd=work, timeout=900
    )
    return final_params_sha(work / "runs" / name)


def _kill_runs_node(run: Path, node: str) -> list[str]:
    """Every process of ``run`` on ``node``: its node agent and all it started (rank host,
    forkserver, ranks, loader workers, writers); another run's processes there live on."""
    agents = [
        p for p in psutil.process_iter(["cmdline"])
        if "hpclaunch.jobs.agent" in " ".join(p.info["cmdline"] or []) and str(run) in " ".join(p.info["cmdline"] or [])
    ]  # fmt: skip
    rank = rank_on_node(run, node)
    ancestors = {p.pid for p in rank.parents()}
    found = []
    for agent in agents:
        if agent.pid in ancestors:
            for p in [agent, *agent.children(recursive=True)]:
                try:
                    found.append((p.pid, " ".join(p.cmdline())[:60]))
                except psutil.Error:
                    continue
    assert found, f"no agent of {run.name} on {node}"
    return kill_together(found)


def _watch_running(run: Path, work: Path, seen: dict[str, Any], stop: threading.Event) -> None:
    """Keeps the first status that says ``run`` is running with steps logged: the limited run's test
    comes after the faulty run's, by when the limited run may be between attempts or done."""
    while not stop.is_set():
        try:
            if last_logged_step(run) >= 2 and (live := status(run, work))["state"] == "running":
                seen["live"] = live
                return
        except (OSError, ValueError, AssertionError):
            pass  # a line being written, or the CLI raced the run's start: ask again
        stop.wait(0.5)


@pytest.fixture(scope="module")
def runs(
    slurm_cluster_3nodes: SlurmCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    """Both runs submitted at once (each test trains its reference once its run has ended: beside
    the runs it would slow them, and their watchdogs' windows are tight)."""
    work = tmp_path_factory.mktemp("slurm-script")
    limited = _submit(
        work, "limited", LIMITED_STEPS,
        "scheduler.nodes=2", "scheduler.procs_per_node=2", "scheduler.time_limit=00:02:00",
        "launch.stop_margin_s=3", "testing.step_sleep_s=0.8", "checkpoint.every_steps=20",
        "testing.step_sleep_resumed=false",  # (its live status is caught in the first attempt)
    )  # fmt: skip
    faulty = _submit(work, "faulty", FAULTY_STEPS, "scheduler.procs_per_node=2", *byo_faults.FAULTY)
    seen: dict[str, Any] = {}
    stop = threading.Event()
    watcher = threading.Thread(target=_watch_running, args=(limited, work, seen, stop), daemon=True)
    watcher.start()
    yield {"work": work, "limited": limited, "faulty": faulty, "limited_live": seen, "watcher": watcher}
    stop.set()
    watcher.join(timeout=30)


@pytest.mark.timeout(900)
def test_a_script_crashed_hung_and_killed_on_slurm_restarts_in_place_and_on_the_spares_bitwise(
    runs: dict[str, Any],
) -> None:
    run, work = runs["faulty"], runs["work"]
    spare = byo_faults.crash_then_hang(run, "n1")
    assert _kill_runs_node(run, spare)
    s = wait_run_done(run, work, timeout=600)
    assert s["state"] == "finished", json.dumps(s, indent=1)[-3000:]
    byo_faults.assert_recovered(s, run, "n1", spare)
    assert final_params_sha(run) == _reference(work, "ref2", 2, FAULTY_STEPS)


@pytest.mark.timeout(900)
def test_a_script_time_limited_on_slurm_is_requeued_and_ends_bitwise(runs: dict[str, Any]) -> None:
    run, work = runs["limited"], runs["work"]
    wait_for(lambda: not runs["watcher"].is_alive(), timeout=300, poll=0.5, what="the limited run running")
    live = runs["limited_live"].get("live")
    assert live and live["state"] == "running" and live["steps"] == LIMITED_STEPS and live["eta_s"], live
    s = wait_run_done(run, work, timeout=800)
    assert s["state"] == "finished", json.dumps(s, indent=1)[-3000:]
    ends = [(a["end"], a["cause"]) for a in s["attempts"]]
    assert ends.count(("requeued", "timeout")) >= 1 and ends[-1] == ("finished", None), ends
    assert len({a["job_id"] for a in s["attempts"]}) == 1  # scontrol requeue: the same job came back
    assert (s["step"], s["steps"]) == (LIMITED_STEPS, LIMITED_STEPS) and 0 < s["time"]["goodput"] < 1
    assert s["step_counts"]["repeated_steps"] == 0
    assert final_params_sha(run) == _reference(work, "ref4", 4, LIMITED_STEPS)
