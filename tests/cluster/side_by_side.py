"""What the 3-node modules share: their runs side by side, the run they all compare against, and
the processes of one job on one node.

The 3-node tests each submit a run, wait for its moment (step 25, the snapshot of step 35), do
something to it (a rank killed, a node's processes killed, an agent stopped) and wait for its end:
mostly waiting (detection windows, start-ups, sleeping steps). One after another they were ~17
minutes of the suite's one SLURM worker, the suite's longest chain. Each such module now starts
its runs together from a module fixture, each run's story (submission, fault, end) in its own
thread (``SideBySide``), and each test takes its run's outcome and asserts; a fault touches only
its own job's processes (``job_processes_on``), never another run's on the same node.

The uninterrupted run that in-place, takeover, fencing and memory-tier runs end bitwise equal to
is one configuration (``COMMON``: the tiny model, world size 4 on two nodes, 80 steps): one run a
session (``common_reference`` in conftest), started with the first module that needs it.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil
import pytest
from tests.runlib import events, kill_together

if TYPE_CHECKING:
    from tests.cluster.conftest import SlurmCluster

STEPS = 80
COMMON = (
    "scheduler.kind=slurm",
    "scheduler.nodes=2",  # tiny: 2 ranks per node, world size 4
    f"train.steps={STEPS}",
    "train.log_every=1",
    "testing.step_sleep_s=0.15",
    "checkpoint.every_steps=20",
    "scheduler.max_failure_retries=2",
    "scheduler.time_limit=00:10:00",
)
SPARE = "scheduler.spare_nodes=1"
# Runs of one module at once: each is 3 agents, up to 3 warm rank hosts and 4 ranks; more at once
# and their start-ups alone keep two cores busy for half a minute.
AT_ONCE = 3


class SideBySide:
    """A module's runs, each story in its own thread (at most ``AT_ONCE`` at a time), started when
    the module's fixture builds it; ``result(name)`` is that story's return value, or raises its
    exception. A story whose tests are all deselected is never started. Leaving the ``with`` waits
    for the stories still running (each bounded by its own waits)."""

    def __init__(self, request: pytest.FixtureRequest) -> None:
        self._selected = {
            name
            for item in request.session.items
            if getattr(item, "module", None) is request.module
            for name in (item.name, getattr(item, "originalname", item.name))
        }
        self._pool = ThreadPoolExecutor(max_workers=AT_ONCE, thread_name_prefix="side-by-side")
        self._futures: dict[str, Future[Any]] = {}

    def start(self, name: str, story: Callable[[], Any], *, for_tests: tuple[str, ...]) -> None:
        """Queue ``story`` unless none of ``for_tests`` (test function names) runs in this session."""
        if self._selected.intersection(for_tests):
            self._futures[name] = self._pool.submit(story)

    def result(self, name: str, timeout: float = 1200) -> Any:
        return self._futures[name].result(timeout=timeout)

    def __enter__(self) -> SideBySide:
        return self

    def __exit__(self, *exc: object) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def job_of(run: Path) -> str:
    """The SLURM job of ``run``'s latest attempt, by its ledger."""
    started = [e for e in events(run) if e["event"] == "started"]
    return str((started or [e for e in events(run) if e["event"] == "submitted"])[-1]["job_id"])


def job_processes_on(
    cluster: SlurmCluster, node: str, job_id: str, *, python_only: bool = False
) -> list[tuple[int, str]]:
    """Every process of job ``job_id`` on ``node`` but SLURM's own (slurmd, slurmstepd): the batch
    script, srun, the agent, its rank host, forkserver, ranks and their helpers, by their
    environment's ``SLURM_JOB_ID`` (other runs share the node). ``python_only``: the agent and what
    it started only (the batch script and srun live on, as when only the agent is OOM-killed)."""
    ns = f"hpcl{cluster.nodes.index(node) + 1}"
    pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, check=True).stdout
    mine = f"SLURM_JOB_ID={job_id}".encode()
    found = []
    for pid in map(int, pids.split()):
        try:
            cmd = " ".join(psutil.Process(pid).cmdline())
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except (psutil.Error, OSError):
            continue
        if "slurmd" in cmd or "slurmstepd" in cmd or mine not in env:
            continue
        # (srun's own command line names python too: only a python process itself is the agent's)
        if python_only and "python" not in cmd.split(" ")[0]:
            continue
        found.append((pid, cmd))  # (whole: a checkout's long path must not cut the module's name off)
    return found


def kill_run_on(cluster: SlurmCluster, run: Path, node: str, *, python_only: bool = False) -> list[str]:
    """SIGKILL every process of ``run``'s current job on ``node`` together (a node's death); the
    command lines killed."""
    return kill_together(job_processes_on(cluster, node, job_of(run), python_only=python_only))
