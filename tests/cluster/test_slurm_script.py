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
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil
import pytest
from tests.runlib import (
    ROOT,
    attempt_ids,
    events,
    final_params_sha,
    hpclaunch,
    kill_together,
    last_logged_step,
    status,
    wait_for,
    wait_run_done,
)

if TYPE_CHECKING:
    from tests.cluster.conftest import SlurmCluster

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

DDP = ROOT / "examples" / "byo" / "gpt_ddp.py"
SMALL = ["--batch", "4", "--block", "16", "--layers", "1", "--d-model", "32", "--workers", "1"]
LIMITED_STEPS = 165  # x 0.8 s of sleep: longer than its two-minute limit on any machine
FAULTY_STEPS = 70


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


def _training_node(run: Path) -> str:
    started = [e for e in events(run) if e["event"] == "started" and e.get("node") == 0]
    return str(started[-1]["roster"]["training"][0])


def _rank_on(run: Path, node: str) -> psutil.Process:
    def found() -> psutil.Process | None:
        from hpclaunch.rundir import RunPaths
        from hpclaunch.rundir.progress_files import read_progress

        for _, record in sorted(read_progress(RunPaths(run), attempt_ids(run)[-1]).items()):
            if record.node == node and record.pid:
                return psutil.Process(record.pid)
        return None

    return wait_for(found, timeout=120, poll=0.2, what=f"a rank of {run.name} on {node}")


def _kill_runs_node(run: Path, node: str) -> list[str]:
    """Every process of ``run`` on ``node``: its node agent and all it started (rank host,
    forkserver, ranks, loader workers, writers); another run's processes there live on."""
    agents = [
        p for p in psutil.process_iter(["cmdline"])
        if "hpclaunch.jobs.agent" in " ".join(p.info["cmdline"] or []) and str(run) in " ".join(p.info["cmdline"] or [])
    ]  # fmt: skip
    rank = _rank_on(run, node)
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
    faulty = _submit(
        work, "faulty", FAULTY_STEPS,
        "scheduler.nodes=1", "scheduler.procs_per_node=2", "scheduler.spare_nodes=2",
        "scheduler.time_limit=00:10:00", "testing.step_sleep_s=0.3", "checkpoint.every_steps=10",
        "checkpoint.memory.every_steps=2", "watchdog.step_min_s=20", "watchdog.step_factor=1",
        "watchdog.poll_s=1", "testing.hang=[{rank: 1, phase: data, step: 30}]", "scheduler.max_failure_retries=2",
    )  # fmt: skip
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
    wait_for(
        lambda: any(e["event"] == "snapshot_saved" and e.get("step", 0) >= 6 for e in events(run)),
        timeout=300,
        poll=0.2,
        what="a snapshot at step 6 or later",
    )
    _rank_on(run, "n1").send_signal(signal.SIGKILL)
    wait_for(
        lambda: len(attempt_ids(run)) >= 3 and last_logged_step(run) >= 45,
        timeout=600,
        poll=0.2,
        what="step 45",
    )
    node = _training_node(run)
    assert node != "n1" and _kill_runs_node(run, node)
    s = wait_run_done(run, work, timeout=600)
    assert s["state"] == "finished", json.dumps(s, indent=1)[-3000:]
    ends = [(a["end"], a["cause"]) for a in s["attempts"]]
    assert ends == [
        ("restarted in place", "crash"), ("restarted in place", "hang"),
        ("restarted in place", "node_failure"), ("finished", None),
    ], ends  # fmt: skip
    assert s["attempts"][1]["resumed_from"] == "memory", s["attempts"][1]
    hang = next(e for e in events(run) if e["event"] == "hang")
    assert hang["ranks"] == [1] and hang["culprit_node"] == "n1", hang
    replaced = [(e["nodes"], e["spare"]) for e in events(run) if e["event"] == "node_replaced"]
    assert [r[0] for r in replaced] == [["n1"], [node]], replaced
    assert (s["step"], s["steps"]) == (FAULTY_STEPS, FAULTY_STEPS)
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
