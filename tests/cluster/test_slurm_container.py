"""Issue 37 on the real local SLURM: runs whose ranks live in a real container image (Charliecloud's
``ch-run``, an image made on this machine: ``tests/containerlib.py``) while each node's agent stays
on the node. Two jobs side by side meet both kinds of recovery: in one a rank SIGKILLed is restarted
in place (the warm rank host in the image kept); the other the one-minute time limit stops, saves
and requeues until it finishes. Both end bitwise equal to the same run without a container. (One
job cannot meet both: an attempt is restarted in place only with more than a minute left.)

Issue 49: the image's /tmp is not the node's in either job (H1): the crash job's ch-run has
``--private-tmp``, the time-limit job's agents a ``$TMPDIR`` of their own (which ch-run binds at /tmp
in place of /tmp); both outlast a short launch window with no hang declared. And in the time-limit
job the first ``scontrol requeue`` fails (a wrapper on the agents' PATH, as a busy slurmctld's
timeout): it is asked again and the run continues (M1)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from tests.containerlib import IMAGE_PYTHON, charliecloud_available, charliecloud_image
from tests.runlib import (
    TINY,
    events,
    final_params_sha,
    hpclaunch,
    outlasting,
    rank_process,
    synth_data,
    tiny_overrides,
    wait_for,
    wait_run_done,
)

if TYPE_CHECKING:
    from tests.cluster.conftest import SlurmCluster

# (a ceiling, not a margin: the module fixture runs two jobs and a reference, on CI beside other modules)
pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(1800)]

# More work than a one-minute limit holds on any machine (its sleep alone).
RUN = (
    *outlasting(80, 0.8, time_limit_s=60, stop_margin_s=4),  # (few steps: see test_slurm_runs)
    "train.log_every=10",
    "checkpoint.every_steps=50",
    "scheduler.max_failure_retries=1",
    "nccl.env.NCCL_DEBUG=WARN",  # (in the plan's environment: it must reach the ranks in the image)
    "watchdog.launch_s=20",  # (attempts outlast it: a rank that never reports is a launch hang)
)
# The first `scontrol requeue` fails as a busy controller's does; every other call is SLURM's own.
SCONTROL = """#!/bin/sh
if [ "$1" = requeue ] && mkdir "{marker}" 2>/dev/null; then
    echo "scontrol: error: Socket timed out on send/recv operation" >&2
    exit 1
fi
exec {real} "$@"
"""


class ContainerRuns:
    """The two runs, finished: their status, what was seen of the crash run's ranks, the reference."""

    def __init__(self, paths: dict[str, Path]):
        self.paths = paths
        self.status: dict[str, dict[str, Any]] = {}
        self.seen: dict[str, Any] = {}
        self.reference = ""
        self.work = Path()


@pytest.fixture(scope="module")
def container_runs(
    slurm_cluster: SlurmCluster,
) -> Iterator[ContainerRuns]:
    why = charliecloud_available()
    if why is not None:
        if os.environ.get("HPCLAUNCH_REQUIRE_CONTAINER") == "1":
            pytest.fail(why)
        pytest.skip(why)
    image = charliecloud_image()
    # Not under /tmp: the time-limit run's $TMPDIR is bound at /tmp in the image, and ch-run makes no
    # mount point under a bind (the run directory under pytest's /tmp could not be mounted there; a
    # real run directory lives on shared storage, and preflight warns about one under /tmp). Its
    # mount points are made in the image below.
    work = Path(tempfile.mkdtemp(prefix="hpclaunch-slurm-container-", dir="/var/tmp"))
    data = synth_data(work / "data")
    inside = (
        "container.runtime=charliecloud",
        f"container.image={image}",
        f"container.python={IMAGE_PYTHON}",
    )
    job_tmp, wrappers = work / "job-tmp", work / "bin"
    job_tmp.mkdir()
    wrappers.mkdir()
    real = shutil.which("scontrol")
    assert real is not None
    (wrappers / "scontrol").write_text(SCONTROL.format(marker=work / "requeue-refused", real=real))
    (wrappers / "scontrol").chmod(0o755)
    limits = {
        "crash": (
            "scheduler.time_limit=00:10:00",
            "container.flags=[--private-tmp]",
            "testing.step_sleep_resumed=true",  # (the attempt in place is looked at while it trains)
        ),
        "timeout": (
            "scheduler.time_limit=00:01:00",
            f"launch.env.TMPDIR={job_tmp}",
            f"launch.env.PATH={wrappers}:{os.environ['PATH']}",
            "launch.stop_margin_s=12",  # (time left after the save for the requeue to be asked again)
        ),
    }
    runs = ContainerRuns({name: work / "runs" / name for name in limits})
    # The image's mount points for what the runs bind (a Charliecloud image is read-only: ch-run makes
    # none outside its /tmp), as a site's image has /scratch; preflight names the ones missing.
    for target in [*runs.paths.values(), data / "tokens", data / "latents"]:
        (image / target.relative_to("/")).mkdir(parents=True, exist_ok=True)
    runs.work = work
    for name, extra in limits.items():
        overrides = tiny_overrides(work, data, name, *RUN, "scheduler.kind=slurm", *extra, *inside)
        hpclaunch("submit", str(TINY), *overrides, "--no-preflight", cwd=work)
    # The same run outside any container, in the foreground meanwhile (no sleep: the math is the same).
    outside = tiny_overrides(work, data, "outside", *RUN, "testing.step_sleep_s=0")
    reference = subprocess.Popen(
        [sys.executable, "-m", "hpclaunch", "train", str(TINY), *outside],
        cwd=work,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        runs.seen = _crash_a_rank(runs.paths["crash"])
        for name, path in runs.paths.items():
            runs.status[name] = wait_run_done(path, work, timeout=1200)
        _, err = reference.communicate(timeout=600)
        assert reference.returncode == 0, err[-3000:]
        runs.reference = final_params_sha(work / "runs" / "outside")
        yield runs
    finally:
        if reference.poll() is None:
            reference.kill()
        for path in runs.paths.values():
            slurm_cluster.cancel(*{str(e["job_id"]) for e in events(path) if e["event"] == "submitted"})
        shutil.rmtree(work, ignore_errors=True)


def _crash_a_rank(run: Path) -> dict[str, Any]:
    """Once the first attempt saved, look at a rank (where it runs, what it was given), kill another."""
    wait_for(
        lambda: any(e["event"] == "checkpoint_saved" and e.get("step") == 50 for e in events(run)),
        timeout=240,
        poll=0.2,
        what="the checkpoint at step 50",
    )
    rank = rank_process(run, 0)
    environ = Path(f"/proc/{rank.pid}/environ").read_bytes().split(b"\0")
    seen = {
        "cmdline": rank.cmdline(),
        "mnt": os.readlink(f"/proc/{rank.pid}/ns/mnt"),
        "forkserver": rank.ppid(),
        "environ": [v.decode(errors="replace") for v in environ],
    }
    rank_process(run, 1).send_signal(signal.SIGKILL)
    wait_for(lambda: len(_started(run)) >= 2, timeout=120, poll=0.2, what="the attempt in place")
    again = rank_process(run, 0)
    seen["forkserver_after"], seen["cmdline_after"] = again.ppid(), again.cmdline()
    return seen


def _started(run: Path) -> list[dict[str, Any]]:
    return [e for e in events(run) if e["event"] == "started" and e.get("node", 0) == 0]


def test_container_ranks_run_in_the_image_with_the_plans_environment(container_runs: ContainerRuns) -> None:
    seen = container_runs.seen
    assert seen["cmdline"][:4] == [IMAGE_PYTHON, "-u", "-m", "hpclaunch.rank.host"]
    assert not Path(IMAGE_PYTHON).exists()  # (the image's own Python: no such file on the node)
    assert seen["mnt"] != os.readlink("/proc/self/ns/mnt")
    assert "NCCL_DEBUG=WARN" in seen["environ"] and "OMP_NUM_THREADS=1" in seen["environ"]
    assert any(v.startswith("HPCLAUNCH_RUN_DIR=") for v in seen["environ"])


def test_container_crashed_rank_is_restarted_in_place_from_the_warm_rank_host_bitwise_equal(
    container_runs: ContainerRuns,
) -> None:
    s = container_runs.status["crash"]
    assert s["state"] == "finished", json.dumps(s, indent=1)[-3000:]
    assert [(a["end"], a["cause"]) for a in s["attempts"]] == [
        ("restarted in place", "crash"),
        ("finished", None),
    ]
    assert s["attempts"][1]["in_place"] and len({a["job_id"] for a in s["attempts"]}) == 1
    # the ranks of the attempt in place were forked from the same forkserver, in the image
    assert container_runs.seen["forkserver_after"] == container_runs.seen["forkserver"]
    assert container_runs.seen["cmdline_after"][0] == IMAGE_PYTHON
    assert final_params_sha(container_runs.paths["crash"]) == container_runs.reference


def test_container_run_stops_at_the_time_limit_requeues_and_ends_bitwise_equal_to_outside(
    container_runs: ContainerRuns,
) -> None:
    s = container_runs.status["timeout"]
    assert s["state"] == "finished", json.dumps(s, indent=1)[-3000:]
    causes = [(a["end"], a["cause"]) for a in s["attempts"]]
    assert len(causes) >= 2 and all(c == ("requeued", "timeout") for c in causes[:-1]), causes
    assert causes[-1] == ("finished", None)
    assert len({a["job_id"] for a in s["attempts"]}) == 1  # scontrol requeue: the same job came back
    assert [a["restart_count"] for a in s["attempts"]] == list(range(len(causes)))
    assert s["step_counts"]["repeated_steps"] == 0 and s["step_counts"]["lost_steps"] == 0
    assert final_params_sha(container_runs.paths["timeout"]) == container_runs.reference
    # the first requeue was refused, asked again, and the run went on (never FAILED for it)
    assert (container_runs.work / "requeue-refused").is_dir()
    run = container_runs.paths["timeout"]
    # (the agent says it on its stderr: the job's output file, beside the attempts' node logs)
    logs = "".join(
        p.read_text(errors="replace") for p in [*run.glob("logs/**/*.log"), *run.glob("scheduler/**/*.out")]
    )
    assert "Socket timed out on send/recv operation; trying again" in logs


@pytest.mark.parametrize("name", ["crash", "timeout"])
def test_container_with_a_private_tmp_or_its_own_tmpdir_trains_past_the_launch_window(
    container_runs: ContainerRuns, name: str
) -> None:
    """The ranks' heartbeats reach their agent (--private-tmp; $TMPDIR bound at /tmp): no hang."""
    run = container_runs.paths[name]
    assert [e for e in events(run) if e["event"] in ("hang", "failed")] == []
    assert not list(run.glob("attempts/*/rank*.progress.json"))  # (node-local, not the fallback)
    node_dir = f"hpclaunch-{os.getuid()}"
    if name == "timeout":
        assert list((container_runs.work / "job-tmp" / node_dir).glob("progress"))
