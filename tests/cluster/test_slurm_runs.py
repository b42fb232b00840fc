"""Real clusters end to end, on the real local SLURM (and Slurm's Torque qsub for PBS).

Each test submits through the real `hpclaunch` CLI and checks the ledger, `status --json` and the
trainer's final parameter hash against an uninterrupted `hpclaunch train` of the same config.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from tests.runlib import (
    TINY,
    events,
    final_params_sha,
    hpclaunch,
    outlasting,
    synth_data,
    tiny_overrides,
    wait_for,
    wait_run_done,
)

if TYPE_CHECKING:
    from tests.cluster.conftest import SlurmCluster

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

# Long enough that a 1-minute SLURM limit cannot hold it on any machine: stopped and continued.
# Few steps, long sleeps: a loaded machine's compute per step does not multiply the attempts.
LONG = (
    *outlasting(80, 0.8, time_limit_s=60, stop_margin_s=4),
    "train.log_every=10",
    "checkpoint.every_steps=20",
)


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cluster-runs")


@pytest.fixture(scope="module")
def data(work: Path) -> Path:
    return synth_data(work / "data")


@pytest.fixture(scope="module")
def reference_sha(work: Path, data: Path) -> str:
    """The same run, uninterrupted, in the foreground (no sleep: the math does not change)."""
    overrides = tiny_overrides(work, data, "reference", *LONG[:1], "testing.step_sleep_s=0", *LONG[2:])
    hpclaunch("train", str(TINY), *overrides, cwd=work, timeout=600)
    return final_params_sha(work / "runs" / "reference")


def _submit(work: Path, data: Path, name: str, *extra: str, env: dict[str, str] | None = None) -> Path:
    hpclaunch(
        "submit", str(TINY), *tiny_overrides(work, data, name, *extra), "--no-preflight", cwd=work, env=env
    )
    return work / "runs" / name


def _attempt_causes(s: dict[str, Any]) -> list[tuple[str, str | None]]:
    return [(a["end"], a["cause"]) for a in s["attempts"]]


# The module's runs that take minutes (one-minute limits reached, requeues restarted): submitted
# together when the first of their tests starts, they run side by side (the local node advertises
# CPUs for eight such jobs) instead of one after another, and each test then waits for its own.
LONG_RUNS = {
    "timeout": ("scheduler.kind=slurm", "scheduler.time_limit=00:01:00", *LONG),
    "preempt": ("scheduler.kind=slurm", "scheduler.time_limit=00:10:00", *LONG),
    # LONG's sleep alone outlasts the one-minute limit on any machine (the PBS deadline is the
    # trainer's own clock: no warning signal comes to make it stop early)
    "pbs": ("scheduler.kind=pbs", "scheduler.time_limit=00:01:00", *LONG),
    # node 0's agent held 45 s between deciding and recording: longer than KillWait (30 s)
    "unended": (
        "scheduler.kind=slurm",
        "scheduler.time_limit=00:10:00",
        "scheduler.max_requeues=1",
        *LONG,
        "testing.pause_before_continue_s=45",
    ),
}
REQUEUED_AFTER_FIRST_SAVE = ("preempt", "unended")


class LongRuns:
    """The long runs of this module, in flight; ``requeued[name]``: the `scontrol requeue` that a
    thread sends once that run saved its first checkpoint (whichever test runs meanwhile)."""

    def __init__(self, cluster: SlurmCluster, work: Path, data: Path, pool: ThreadPoolExecutor) -> None:
        self.runs = {name: _submit(work, data, name, *extra) for name, extra in LONG_RUNS.items()}
        self.requeued: dict[str, Future[str]] = {
            name: pool.submit(_requeue_after_first_save, cluster, self.runs[name])
            for name in REQUEUED_AFTER_FIRST_SAVE
        }


def _requeue_after_first_save(cluster: SlurmCluster, run: Path) -> str:
    """`scontrol requeue` of ``run``'s job once it saved a checkpoint; the job id."""
    job_id = str(next(e["job_id"] for e in events(run) if e["event"] == "submitted"))
    wait_for(lambda: any(e["event"] == "checkpoint_saved" for e in events(run)), timeout=240, what="a save")
    cluster.run("scontrol", "requeue", job_id)
    return job_id


@pytest.fixture(scope="module")
def long_runs(slurm_cluster: SlurmCluster, work: Path, data: Path) -> Iterator[LongRuns]:
    with ThreadPoolExecutor(max_workers=len(REQUEUED_AFTER_FIRST_SAVE)) as pool:
        yield LongRuns(slurm_cluster, work, data, pool)


@pytest.mark.timeout(1200)  # (a ceiling: on a loaded CI machine each one-minute attempt's start-up
# took most of its minute, and the run needed 15 attempts for 80 steps)
def test_timeout_warns_saves_requeues_and_ends_bitwise_equal(
    long_runs: LongRuns, work: Path, reference_sha: str
) -> None:
    run = long_runs.runs["timeout"]
    s = wait_run_done(run, work, timeout=1080)
    assert s["state"] == "finished", json.dumps(s, indent=1)[-3000:]
    causes = _attempt_causes(s)
    assert len(causes) >= 2 and all(c == ("requeued", "timeout") for c in causes[:-1]), causes
    assert causes[-1][0] == "finished"
    job_ids = {a["job_id"] for a in s["attempts"]}
    assert len(job_ids) == 1  # the same SLURM job came back (scontrol requeue), restart counts grow
    assert [a["restart_count"] for a in s["attempts"]] == list(range(len(causes)))
    assert s["step_counts"]["repeated_steps"] == 0 and s["step_counts"]["lost_steps"] == 0
    assert final_params_sha(run) == reference_sha
    # logs survive restarts: one log per node per attempt
    assert len(list((run / "logs").glob("attempt-*/node0.log"))) == len(causes)


def test_scontrol_requeue_is_a_preemption_with_nothing_lost(
    long_runs: LongRuns, work: Path, reference_sha: str
) -> None:
    """`scontrol requeue` after the first checkpoint (sent by the fixture's thread)."""
    run = long_runs.runs["preempt"]
    long_runs.requeued["preempt"].result(timeout=300)
    s = wait_run_done(run, work, timeout=480)
    assert s["state"] == "finished", json.dumps(s, indent=1)[-3000:]
    assert _attempt_causes(s)[0] == ("requeued", "preemption")
    stopped = [e for e in events(run) if e["event"] == "stopped"]
    assert stopped and stopped[0]["cause"] == "preemption"  # every rank saved within the kill wait
    assert s["step_counts"]["repeated_steps"] == 0 and s["step_counts"]["lost_steps"] == 0
    assert final_params_sha(run) == reference_sha


def test_pbs_run_continues_through_a_continuation_job(
    long_runs: LongRuns, work: Path, reference_sha: str
) -> None:
    run = long_runs.runs["pbs"]
    s = wait_run_done(run, work, timeout=480)
    assert s["state"] == "finished", json.dumps(s, indent=1)[-3000:]
    causes = _attempt_causes(s)
    assert len(causes) >= 2 and causes[0] == ("requeued", "timeout"), causes
    job_ids = [a["job_id"] for a in s["attempts"]]
    assert len(set(job_ids)) == len(job_ids)  # each continuation is its own PBS job
    requeues = [e for e in events(run) if e["event"] == "requeued"]
    assert all(e.get("job_id") for e in requeues)  # qsub -W depend=afterany:... answered a job id
    assert final_params_sha(run) == reference_sha


def test_sweep_is_one_array_and_every_point_finishes(
    slurm_cluster: SlurmCluster, work: Path, data: Path
) -> None:
    overrides = tiny_overrides(
        work, data, "sweep", "scheduler.kind=slurm", "train.steps=25", "train.warmup_steps=5"
    )
    hpclaunch("submit", str(TINY), *overrides, "--sweep", "train.lr=1e-3,5e-4", "--no-preflight", cwd=work)
    root = work / "runs" / "sweep"
    sweep = json.loads((root / "sweep.json").read_text())
    assert len(sweep["points"]) == 2 and "," not in sweep["job_id"]  # one array job
    for point in sweep["points"]:
        s = wait_run_done(Path(point["run_dir"]), work, timeout=300)
        assert s["state"] == "finished", s
    info = slurm_cluster.job_info(f"{sweep['job_id']}_0")
    assert info.get("ArrayJobId") == sweep["job_id"]
    table = json.loads(hpclaunch("status", str(root), "--json", cwd=work).stdout)
    assert [Path(p["run"]).name for p in table["points"]] == [p["name"] for p in sweep["points"]]


def test_scancel_is_cancelled_not_failed_nor_requeued(
    slurm_cluster: SlurmCluster, work: Path, data: Path
) -> None:
    run = _submit(work, data, "cancel", "scheduler.kind=slurm", "scheduler.time_limit=00:10:00", *LONG)
    job_id = next(e["job_id"] for e in events(run) if e["event"] == "submitted")
    wait_for(lambda: any(e["event"] == "resumed" for e in events(run)), timeout=120, what="training to start")
    slurm_cluster.run("scancel", str(job_id))
    s = wait_run_done(run, work, timeout=120)
    assert s["state"] == "cancelled", json.dumps(s, indent=1)[-3000:]
    assert not any(e["event"] == "requeued" for e in events(run))
    assert not any(e["event"] == "failed" for e in events(run))


def test_two_node_job_trains_with_world_size_four(
    slurm_cluster_2nodes: SlurmCluster, work: Path, data: Path
) -> None:
    run = _submit(
        work,
        data,
        "twonode",
        "scheduler.kind=slurm",
        "scheduler.nodes=2",
        "scheduler.procs_per_node=2",
        "train.global_batch=16",
        "train.micro_batch=2",
        "train.steps=25",
        "train.warmup_steps=5",
    )
    s = wait_run_done(run, work, timeout=300)
    assert s["state"] == "finished", json.dumps(s, indent=1)[-3000:]
    started = [e for e in events(run) if e["event"] == "started"]
    assert sorted(e["node"] for e in started) == [0, 1]
    assert {tuple(e["hosts"]) for e in started} == {("n1", "n2")}
    resumed = next(e for e in events(run) if e["event"] == "resumed")
    assert resumed["world_size"] == 4
    log = (run / "logs").glob("attempt-*/node0.log")
    text = next(log).read_text()
    assert '"rdzv_endpoint": "10.200.0.11:' in text  # the head's NodeAddr, never localhost


def test_a_node_that_fails_a_check_is_excluded_and_the_run_finishes_on_another(
    slurm_cluster_2nodes: SlurmCluster, work: Path, data: Path, tmp_path: Path
) -> None:
    """The node check's admin marker (`unhealthy-<node>`) on n1: the job requeues without n1."""
    markers = tmp_path / "markers"
    markers.mkdir()
    (markers / "unhealthy-n1").write_text("test: ECC errors reported by the admin\n")
    run = _submit(
        work,
        data,
        "exclude",
        "scheduler.kind=slurm",
        "train.steps=20",
        "train.warmup_steps=5",
        env={"HPCLAUNCH_NODE_MARKER_DIR": str(markers)},
    )
    s = wait_run_done(run, work, timeout=300)
    assert s["state"] == "finished", json.dumps(s, indent=1)[-3000:]
    story = events(run)
    started = [e for e in story if e["event"] == "started"]
    assert started[0]["hosts"] == ["n1"], "SLURM placed the first attempt elsewhere; nothing to exclude"
    assert started[-1]["hosts"] == ["n2"]
    excluded = [e for e in story if e["event"] == "node_excluded"]
    assert [e["nodes"] for e in excluded] == [["n1"]] and excluded[0]["node"] == 0
    failed_check = next(e for e in story if e["event"] == "node_preflight" and not e["ok"])
    assert any(c["name"] == "node" and c["status"] == "fail" for c in failed_check["checks"])
    assert (s["attempts"][0]["end"], s["attempts"][0]["cause"]) == ("requeued", "node_failure")
    assert started[-1]["job_id"] != started[0]["job_id"]  # a new job, submitted with --exclude=n1
    assert "n1" in slurm_cluster_2nodes.job_info(str(started[-1]["job_id"])).get("ExcNodeList", "")
    assert "#SBATCH --exclude=n1" in (run / "job.sbatch").read_text()


def test_scancel_after_the_warning_signal_is_a_cancellation_not_a_timeout(
    slurm_cluster: SlurmCluster, work: Path, data: Path
) -> None:
    """The warning (USR2, as `--signal` sends it) and then a user's scancel: never requeued."""
    # The agent waits 8 s between deciding to continue and asking Slurm (under KillWait, 30 s):
    # the scancel below lands in that window on any machine, never after the requeue.
    run = _submit(
        work,
        data,
        "warncancel",
        "scheduler.kind=slurm",
        "scheduler.time_limit=00:10:00",
        *LONG,
        "testing.pause_before_continue_s=8",
    )
    job_id = next(e["job_id"] for e in events(run) if e["event"] == "submitted")
    wait_for(lambda: any(e["event"] == "resumed" for e in events(run)), timeout=120, what="training to start")
    slurm_cluster.run("scancel", "--signal=USR2", str(job_id))
    wait_for(
        lambda: any(e["event"] == "stop_requested" and e.get("source") == "SIGUSR2" for e in events(run)),
        timeout=30,
        what="the agent to take the warning",
    )
    slurm_cluster.run("scancel", str(job_id))
    s = wait_run_done(run, work, timeout=120)
    assert s["state"] == "cancelled", json.dumps(s, indent=1)[-3000:]
    story = events(run)
    assert not any(e["event"] in ("requeued", "failed") for e in story), story
    assert any(e["event"] == "cancelled" and e.get("node") == 0 for e in story)


def test_a_non_head_node_that_fails_its_check_is_decided_once_by_the_head(
    slurm_cluster_2nodes: SlurmCluster, work: Path, data: Path, tmp_path: Path
) -> None:
    """n2 (node 1) is marked unhealthy in a 2-node job: node 0 hears it before anyone starts
    torchrun, decides once (exclude n2), and no second job ever owns the run directory."""
    markers = tmp_path / "markers"
    markers.mkdir()
    (markers / "unhealthy-n2").write_text("test: fabric errors\n")
    run = _submit(
        work,
        data,
        "nonhead",
        "scheduler.kind=slurm",
        "scheduler.nodes=2",
        "train.steps=10",
        "train.warmup_steps=2",
        env={"HPCLAUNCH_NODE_MARKER_DIR": str(markers)},
    )
    s = wait_run_done(run, work, timeout=240)
    story = events(run)
    checks = {e["node"]: e["ok"] for e in story if e["event"] == "node_preflight"}
    assert checks == {0: True, 1: False}, story
    decisions = [e for e in story if e["event"] in ("node_excluded", "requeued", "failed", "finished")]
    assert decisions and all(e.get("node") == 0 for e in decisions), decisions
    assert [e["nodes"] for e in story if e["event"] == "node_excluded"] == [["n2"]]
    # Two nodes exist and one is excluded: SLURM refuses the new job, and the run says so.
    assert s["state"] == "failed" and "n2" in (s["attempts"][-1]["error"] or ""), json.dumps(s, indent=1)[
        -2000:
    ]
    first = str(next(e["job_id"] for e in story if e["event"] == "submitted"))
    info = slurm_cluster_2nodes.job_info(first)
    assert info.get("Restarts", "0") == "0"  # the old job was never requeued
    assert not list((run / "logs").glob("attempt-*/node*.log"))  # no node ever started torchrun


def test_a_requeue_after_the_budget_is_spent_is_withdrawn(
    slurm_cluster: SlurmCluster, work: Path, data: Path
) -> None:
    """max_requeues=0 and an `scontrol requeue`: the run fails; the attempt Slurm starts anyway
    cancels itself instead of training on, and the ledger says why."""
    run = _submit(
        work,
        data,
        "overbudget",
        "scheduler.kind=slurm",
        "scheduler.time_limit=00:10:00",
        "scheduler.max_requeues=0",
        *LONG,
    )
    job_id = next(e["job_id"] for e in events(run) if e["event"] == "submitted")
    wait_for(lambda: any(e["event"] == "resumed" for e in events(run)), timeout=120, what="training to start")
    slurm_cluster.run("scontrol", "requeue", str(job_id))
    wait_for(lambda: any(e["event"] == "held" for e in events(run)), timeout=240, what="the withdrawal")
    s = wait_run_done(run, work, timeout=120)
    story = events(run)
    failed = next(e for e in story if e["event"] == "failed")
    assert failed["cause"] == "preemption" and "0 requeues used of 0" in failed["reason"]
    held = next(e for e in story if e["event"] == "held")
    assert "already ended (failed)" in held["reason"] and "cancelled job" in held.get("note", "")
    assert s["state"] == "failed", json.dumps(s, indent=1)[-2000:]
    assert len([e for e in story if e["event"] == "resumed"]) == 1  # it never trained again


def test_an_attempt_whose_agent_was_killed_before_deciding_is_decided_by_the_next_one(
    long_runs: LongRuns, work: Path, reference_sha: str
) -> None:
    """`scontrol requeue`, and node 0's agent takes longer than KillWait (30 s) to record its
    decision (held 45 s between deciding and recording: as a slow stop save or a slow filesystem
    would): Slurm SIGKILLs it first and starts the job again. The new attempt decides for the old
    one (a preemption, one requeue spent), trains on from the last checkpoint and ends bitwise
    equal; the run's budgets are never bypassed this way. (A SIGSTOPped agent would not do:
    Slurm sends SIGCONT before it signals a job.)"""
    run = long_runs.runs["unended"]
    long_runs.requeued["unended"].result(timeout=300)
    s = wait_run_done(run, work, timeout=480)
    assert s["state"] == "finished", json.dumps(s, indent=1)[-3000:]
    first = s["attempts"][0]
    assert (first["end"], first["cause"]) == ("requeued", "preemption"), first
    decided = [e for e in events(run) if e["event"] == "requeued" and e.get("attempt") == first["attempt"]]
    assert len(decided) == 1 and decided[0]["by"] == "scheduler", decided
    assert "ended without a decision" in decided[0]["reason"] and decided[0]["counts_as"] == "requeue"
    assert s["attempts"][1]["restart_count"] == 1 and s["attempts"][1]["resumed_step"] > 0
    assert final_params_sha(run) == reference_sha


def test_node_lists_come_from_scontrol(slurm_cluster: SlurmCluster) -> None:
    from hpclaunch.schedulers.protocol import NodeContextError
    from hpclaunch.schedulers.slurm import scontrol_hostnames

    assert scontrol_hostnames("rack[1-2]-n[01-02]") == ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]
    assert scontrol_hostnames("n1x,n2x,gpu[07-08]") == ["n1x", "n2x", "gpu07", "gpu08"]
    # What this Slurm cannot expand is an error naming the list, never an empty node list.
    with pytest.raises(NodeContextError, match=r"cannot expand SLURM_JOB_NODELIST='n\[1-2\]x'"):
        scontrol_hostnames("n[1-2]x")
