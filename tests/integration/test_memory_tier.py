"""The memory tier (``checkpoint.memory``) across real processes: torchrun with 2 gloo ranks on one
node, snapshots in shared memory between the checkpoints on disk.

A rank killed while training resumes from the newest complete snapshot, not from the older disk
checkpoint; a rank killed while its snapshot's job writes its shard leaves a half-made one that is never
read (the previous complete snapshot is); both runs end bitwise equal to a run without faults, the
ledger says which tier each resume came from, and the node's memory is freed when the run ends.
The same through the node agent and the local scheduler: an in-place restart after a SIGKILL.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
from tests.runlib import (
    TINY,
    events,
    final_params_sha,
    hpclaunch,
    rank_process,
    synth_data,
    tiny_overrides,
    wait_for,
    wait_run_done,
)
from tests.shm_fixtures import small_tmpfs

from hpclaunch.config import load_config
from hpclaunch.rank.checkpoint import ENV_KILL
from hpclaunch.rank.checkpoint.fault_hooks import ENV_SNAPSHOT_DELAY_COPY
from hpclaunch.rank.memory_tier import snapshot_dir
from hpclaunch.rundir import SNAPSHOT_SAVED, RunPaths, read_events
from hpclaunch.rundir.env import NODE_NAME_VAR
from hpclaunch.rundir.shm import run_root

sys.path.insert(0, str(Path(__file__).parent / "helpers"))
import trainer_helpers as h

pytestmark = pytest.mark.slow

# Disk every 20 steps, memory every 5: what the issue asks for.
TIERS = ["checkpoint.every_steps=20", "checkpoint.memory.every_steps=5"]
# The disk saves blocking in the tests that kill at a snapshot: which tier is newer is then known;
# and the steps leave the writers some CPU (on two cores the tiny model's ranks take both, and a
# snapshot's first writer imports torch: it would finish after the 60 steps do).
DISK_AT_ONCE = ["checkpoint.async_save=false", "testing.step_sleep_s=0.1"]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("memory")


@pytest.fixture(scope="module")
def data(root: Path) -> Path:
    return h.make_data(root)


@pytest.fixture(scope="module")
def reference(root: Path, data: Path) -> str:
    run = h.make_run(root, "reference", data)
    proc = h.train(run)
    assert proc.returncode == 0, h.describe(proc)
    return str(h.outcome(run)["params_sha256"])


def resumed(run: Path, attempt: str) -> dict[str, Any]:
    (event,) = [e.record for e in read_events(RunPaths(run)).named("resumed") if e.attempt == attempt]
    return event


def base_of(run: Path) -> Path:
    """The run's own tmpfs stand-in (``checkpoint.memory.dir``: it must exist, it is never made)."""
    base = Path(str(run) + "-shm")
    base.mkdir(exist_ok=True)
    return base


def shm_of(run: Path) -> Path:
    """Where the run's snapshots live: one directory per node below it."""
    return run_root(load_config(run / "config.yaml").checkpoint.memory, RunPaths(run))


def killed_in_a_snapshot(root: Path, data: Path, name: str, kill: str) -> tuple[Path, int, int]:
    """A run whose rank is SIGKILLed while its snapshot's job writes its shard (``ENV_KILL``: step,
    rank, phase ``write``), then resumed as attempt a2, which must finish; with the step of the
    half-made snapshot and the newest that rank 0 had noted as saved when the rank died."""
    run = h.make_run(
        root, name, data, [*TIERS, *DISK_AT_ONCE, f"checkpoint.memory.dir={base_of(root / name)}"]
    )
    crashed = subprocess.run(
        h.command(run), env=h.env_for("a1", {ENV_KILL: kill}), capture_output=True, text=True, timeout=300
    )
    assert crashed.returncode != 0, h.describe(crashed)
    (half,) = shm_of(run).glob("*/alloc-*/step-*/.rank-*.bin.tmp")  # the half-made shard, left as it was
    killed, rank = int(half.parent.name.split("-")[1]), half.name.split(".")[1]
    saved = [int(e["step"]) for e in h.events(run) if e["event"] == SNAPSHOT_SAVED]
    before = half.parent.parent / f"step-{saved[-1]:08d}-w2"
    assert saved and saved[-1] < killed and (before / f"{rank}.json").is_file(), (saved, killed)
    assert not (half.parent / f"{rank}.json").exists()  # never published
    proc = h.train(run, attempt="a2")
    assert proc.returncode == 0, h.describe(proc)
    return run, killed, saved[-1]


def test_a_snapshot_half_written_when_its_rank_died_is_never_restored(
    reference: str, root: Path, data: Path
) -> None:
    run, killed, newest = killed_in_a_snapshot(root, data, "half-written", "35:0:write")
    r = resumed(run, "a2")
    # the newest complete tier, never the half-made snapshot
    on_disk = 40 if killed > 40 else 20
    expected = (newest, "memory") if newest > on_disk else (on_disk, "disk")
    assert (r["step"], r["tier"], r["disk_step"]) == (*expected, on_disk), (r, killed, newest)
    assert h.outcome(run, "a2")["params_sha256"] == reference
    assert not shm_of(run).exists()  # the run ended with its last save on disk: the memory is freed


def test_without_a_snapshot_newer_than_the_disk_the_disk_tier_serves(
    reference: str, root: Path, data: Path
) -> None:
    # Killed while writing the snapshot of step 25: the complete ones (15 at most: memory skips the
    # disk's step 20) are older than the disk's 20.
    run, killed, newest = killed_in_a_snapshot(root, data, "disk-newer", "25:1:write")
    r = resumed(run, "a2")
    assert killed == 25 and newest < 20 and (r["step"], r["tier"], r["disk_step"]) == (20, "disk", 20), r
    assert h.outcome(run, "a2")["params_sha256"] == reference


def test_a_crash_restarted_in_place_resumes_from_memory_not_the_disk(tmp_path: Path) -> None:
    """Through the node agent on the local scheduler: SIGKILL of a rank after the snapshot of step
    35 is complete; the in-place restart resumes from memory (35 or later), not from the disk's 20,
    and the run ends bitwise equal to one that never crashed. The default place, /dev/shm."""
    data = synth_data(tmp_path / "data")
    slow = ["testing.step_sleep_s=0.1", "train.log_every=1", "launch.stop_margin_s=3"]
    ref = tiny_overrides(tmp_path, data, "mem-ref", *slow, "train.steps=90", "testing.step_sleep_s=0")
    hpclaunch("train", str(TINY), *ref, cwd=tmp_path, timeout=600)
    run = tmp_path / "runs" / "mem"
    overrides = tiny_overrides(
        tmp_path, data, "mem", *slow, *TIERS, "train.steps=90", "scheduler.max_failure_retries=1"
    )
    hpclaunch("submit", str(TINY), *overrides, "--no-preflight", cwd=tmp_path)
    wait_for(
        lambda: any(e["event"] == SNAPSHOT_SAVED and e.get("step", 0) >= 35 for e in events(run)),
        timeout=240,
        poll=0.1,
        what="a snapshot at step 35 or later",
    )
    rank_process(run, 0).send_signal(signal.SIGKILL)
    s = wait_run_done(run, tmp_path, timeout=300)
    assert s["state"] == "finished", json.dumps(s, indent=1)[-3000:]
    first, second = s["attempts"]
    assert (first["end"], first["cause"]) == ("restarted in place", "crash") and second["in_place"]
    story = events(run)
    r = [e for e in story if e["event"] == "resumed"][-1]
    noted = [e["step"] for e in story if e["event"] == SNAPSHOT_SAVED and e["attempt"] == first["attempt"]]
    # The newest complete tier: at least the newest snapshot the ledger had noted (one published
    # since, not noted yet, may be newer) and the disk's; a disk save published after the snapshot
    # of 35 was seen may be the newer one on a loaded machine.
    on_disk = r["disk_step"] or 0  # (None: the disk's first save was not published yet: loaded box)
    assert max(noted) >= 35 and r["step"] >= max(max(noted), on_disk), (r, noted)
    assert r["tier"] == ("memory" if r["step"] > on_disk else "disk")
    assert second["resumed_step"] == r["step"] and second["resumed_from"] == r["tier"]
    if r["tier"] == "memory":  # what status says it saved
        assert second["memory_saved_steps"] == r["step"] - on_disk > 0
    assert final_params_sha(run) == final_params_sha(tmp_path / "runs" / "mem-ref")
    cfg = load_config(TINY, [o for o in overrides if o != "--set"], base=tmp_path)
    assert not snapshot_dir(cfg, RunPaths(run)).exists()  # freed at the end


def _start_nodes(
    run: Path,
    attempt: str,
    names: list[str],
    kill: str | None = None,
    env: dict[str, dict[str, str]] | None = None,
) -> list[subprocess.Popen[str]]:
    """The run as one node of one rank per name on this machine (a torchrun each, static
    rendezvous), each naming its node as the node agent would: as many stores in one tmpfs."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for node, name in enumerate(names):
        cmd = h.command(run, 1, node=(len(names), node, port))
        extra = {NODE_NAME_VAR: name, **({ENV_KILL: kill} if kill else {}), **(env or {}).get(name, {})}
        procs.append(subprocess.Popen(cmd, env=h.env_for(attempt, extra), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))  # fmt: skip
    return procs


def _ended(
    procs: list[subprocess.Popen[str]], timeout: float = 300
) -> list[subprocess.CompletedProcess[str]]:
    done = []
    for p in procs:
        out, _ = p.communicate(timeout=timeout)
        done.append(subprocess.CompletedProcess(p.args, p.returncode, out, ""))
    return done


def _nodes(
    run: Path, attempt: str, names: list[str], kill: str | None = None
) -> list[subprocess.CompletedProcess[str]]:
    return _ended(_start_nodes(run, attempt, names, kill))


def test_a_node_agent_sweeps_what_ended_allocations_of_its_user_left(tmp_path: Path) -> None:
    """Snapshots that an allocation killed outright left (its agent SIGKILLed too: nobody freed
    them) are freed by the next agent of the same user on the node, whatever the run; those a live
    process holds are not."""
    from hpclaunch.rundir.shm import DEFAULT_BASE, Hold, user_root

    tag = uuid.uuid4().hex[:8]
    left = user_root(DEFAULT_BASE) / f"test-{tag}-left" / "node" / "alloc-1.0"
    held = user_root(DEFAULT_BASE) / f"test-{tag}-held" / "node" / "alloc-1.0"
    Hold(left, DEFAULT_BASE).release()  # (made, then its process gone)
    (left / "step-00000005-w2").mkdir()
    (left / "step-00000005-w2" / "rank-00000.bin").write_bytes(b"x" * 4096)
    alive = Hold(held, DEFAULT_BASE)
    try:
        data = synth_data(tmp_path / "data")
        overrides = tiny_overrides(tmp_path, data, "sweeps", *TIERS, "train.steps=6", "train.warmup_steps=1")
        hpclaunch("submit", str(TINY), *overrides, "--no-preflight", "--wait", cwd=tmp_path)
        assert not left.exists() and not left.parent.parent.exists()
        assert held.is_dir()
    finally:
        alive.free()


def test_a_peer_stuck_past_wait_s_makes_the_tier_step_aside_and_the_run_goes_on(
    reference: str, root: Path, data: Path
) -> None:
    """Node nb's snapshot jobs are held 2 s before their copies (a test hook): its buddy does not
    hear from it within ``wait_s`` (1 s, gloo's timeout on the tier's link), the link breaks, and
    the tier steps aside on both ranks, each saying so once; the run finishes as one without the
    tier (before: every join
    waited as long as the job took, and a stop's save behind it for gloo's 30 minutes; a broken link
    failed every later snapshot, each said in gloo's words)."""
    run, _ = _on_nodes(root, "stuck-peer", data, 2)
    config = run / "config.yaml"
    config.write_text(config.read_text().replace("wait_s: 30.0", "wait_s: 1.0"))
    assert "wait_s: 1.0" in config.read_text()
    done = _ended(_start_nodes(run, "a1", ["na", "nb"], env={"nb": {ENV_SNAPSHOT_DELAY_COPY: "2"}}))
    assert all(p.returncode == 0 for p in done), [p.stdout[-6000:] for p in done]
    assert h.outcome(run)["params_sha256"] == reference
    said = [e for e in h.events(run) if e["event"] == "snapshot_failed"]
    assert sorted(e["rank"] for e in said) == [0, 1], said  # once each, not at every snapshot
    assert all("the memory tier is off for the rest of this attempt" in e["error"] for e in said), said
    assert any("did not answer within 1 s (checkpoint.memory.wait_s)" in e["error"] for e in said), said
    assert not any("[/" in e["error"] or "GLHF" in e["error"] for e in said), said  # the user's words


def test_a_run_that_fails_leaves_nothing_in_shared_memory(tmp_path: Path) -> None:
    """A rank SIGKILLed with no retry left: the run fails, and the node agent frees what the run
    held in /dev/shm (its ranks died without freeing; before, the snapshots stayed until the same
    run landed on the same node again)."""
    data = synth_data(tmp_path / "data")
    overrides = tiny_overrides(
        tmp_path, data, "fails", "testing.step_sleep_s=0.1", *TIERS, "scheduler.max_failure_retries=0"
    )
    run = tmp_path / "runs" / "fails"
    hpclaunch("submit", str(TINY), *overrides, "--no-preflight", cwd=tmp_path)
    wait_for(
        lambda: any(e["event"] == SNAPSHOT_SAVED for e in events(run)),
        timeout=240,
        poll=0.1,
        what="a snapshot",
    )
    cfg = load_config(TINY, [o for o in overrides if o != "--set"], base=tmp_path)
    held = snapshot_dir(cfg, RunPaths(run))
    assert [*held.glob("*/alloc-*/step-*/rank-*.bin")]
    rank_process(run, 0).send_signal(signal.SIGKILL)
    s = wait_run_done(run, tmp_path, timeout=300)
    assert s["state"] == "failed", json.dumps(s, indent=1)[-3000:]
    assert not held.exists(), [*held.rglob("*")]


def _on_nodes(root: Path, name: str, data: Path, nodes: int) -> tuple[Path, Path]:
    layout = ["scheduler.kind=slurm", f"scheduler.nodes={nodes}", "scheduler.procs_per_node=1"]
    batch = ["train.global_batch=24", "train.micro_batch=4"] if nodes == 3 else []
    run = h.make_run(
        root,
        name,
        data,
        [*layout, *batch, *TIERS, *DISK_AT_ONCE, f"checkpoint.memory.dir={base_of(root / name)}"],
    )
    return run, shm_of(run)


def test_a_snapshot_whose_rank_died_sending_it_to_its_buddy_is_never_restored(
    reference: str, root: Path, data: Path
) -> None:
    """Two nodes, each rank's snapshot copied to the other node: rank 1 SIGKILLed while it sends its
    snapshot of step 35 (sizes told, payload not sent). Neither its copy nor its buddy's was
    published, so 35 is whole nowhere: the restart resumes from 30, each rank from its own node."""
    run, shm = _on_nodes(root, "died-sending", data, 2)
    first = _nodes(run, "a1", ["na", "nb"], kill="35:1:send")
    assert any(p.returncode != 0 for p in first), [p.stdout[-2000:] for p in first]
    assert [*(shm / "na").glob(f"alloc-*/step-{30:08d}-w2/rank-00001.json")]  # 30: whole on both nodes
    assert not [*(shm / "nb").glob(f"alloc-*/step-{35:08d}-w2/rank-00001.json")]  # 35: never published
    second = _nodes(run, "a2", ["na", "nb"])
    assert all(p.returncode == 0 for p in second), [p.stdout[-3000:] for p in second]
    r = resumed(run, "a2")
    assert (r["step"], r["tier"], r["disk_step"]) == (30, "memory", 20), r
    assert r["shards_from"] == {"na": [0], "nb": [1]}
    assert h.outcome(run, "a2")["params_sha256"] == reference
    assert not shm.exists()


def test_three_nodes_a_node_lost_with_its_memory_is_restored_from_its_buddy(root: Path, data: Path) -> None:
    """Three nodes of one rank (each rank trades snapshots with two others: its buddy on the next
    node and its ward on the previous one). Rank 0 dies at the snapshot of 35, its node's memory is
    lost with it, and a new node ``nd`` runs rank 0: it is sent rank 0's shard of 30 by ``nb``, which
    kept it as rank 0's buddy. The run ends as one that was never interrupted."""
    ref, _ = _on_nodes(root, "three-ref", data, 3)
    assert all(p.returncode == 0 for p in _nodes(ref, "a1", ["ra", "rb", "rc"]))
    run, shm = _on_nodes(root, "three", data, 3)
    first = _nodes(run, "a1", ["na", "nb", "nc"], kill="35:0:write")
    assert any(p.returncode != 0 for p in first)
    for node, kept in [("na", [0, 2]), ("nb", [0, 1]), ("nc", [1, 2])]:  # its own rank and its ward's
        (step30,) = (shm / node).glob(f"alloc-*/step-{30:08d}-w3")
        assert sorted(int(p.name[5:10]) for p in step30.glob("rank-*.json")) == kept, node
    shutil.rmtree(shm / "na")  # the node died with its memory
    second = _nodes(run, "a2", ["nd", "nb", "nc"])
    assert all(p.returncode == 0 for p in second), [p.stdout[-3000:] for p in second]
    r = resumed(run, "a2")
    assert (r["step"], r["tier"], r["disk_step"]) == (30, "memory", 20), r
    assert r["shards_from"] == {"nb": [0, 1], "nc": [2]}
    assert h.outcome(run, "a2")["params_sha256"] == h.outcome(ref)["params_sha256"]
    assert not shm.exists()


# The tiny model's shard is ~4.0 MiB (348k parameters, fp32, AdamW's two moments): on a 10 MiB tmpfs
# both "nodes'" own shards of the first snapshot fit, their buddies' copies do not, and the next
# snapshots' own shards no longer fit either (keep_last 1: the one kept is still there).
FULL = ["checkpoint.memory.keep_last=1"]


def _on_a_full_tmpfs(root: Path, name: str, data: Path, shm: Path, *extra: str) -> Path:
    layout = ["scheduler.kind=slurm", "scheduler.nodes=2", "scheduler.procs_per_node=1"]
    return h.make_run(root, name, data, [*layout, *TIERS, *FULL, *extra, f"checkpoint.memory.dir={shm}"])


def _said(run: Path) -> list[dict[str, Any]]:
    return [e for e in h.events(run) if e["event"] == "snapshot_failed"]


def test_a_run_whose_tmpfs_is_full_finishes_as_one_without_the_tier_and_says_so_once_per_rank(
    reference: str, root: Path, data: Path, tmp_path: Path
) -> None:
    """The review's reproduction: room for the own shards, not for the buddies' copies. No snapshot
    stalls the loop: the run finishes, bitwise equal to one without the tier, and each rank says
    once, in its words, what the tier could not do. (Before: gloo received into a sparse file, and
    EFAULT broke the link; rank 0 alone said gloo's transport error at every snapshot; on the real
    SLURM cluster the run failed after 283 s.)"""
    with small_tmpfs(tmp_path / "shm", "10m") as shm:
        run = _on_a_full_tmpfs(root, "full-tmpfs", data, shm)
        done = _nodes(run, "a1", ["na", "nb"])
        assert all(p.returncode == 0 for p in done), [p.stdout[-3000:] for p in done]
        assert h.outcome(run)["params_sha256"] == reference
        said = _said(run)
        assert sorted(e["rank"] for e in said) == [0, 1], said  # once per rank, not per snapshot
        for e in said:
            assert "no room for a snapshot shard of" in e["error"] and f"in {shm} (" in e["error"], e
            assert e["error"].endswith("training goes on, the disk tier serves"), e
        out = "".join(p.stdout for p in done)
        assert out.count("hpclaunch: rank 0 on na: ") == 1 and out.count("hpclaunch: rank 1 on nb: ") == 1
        assert not [
            *run_root(load_config(run / "config.yaml").checkpoint.memory, RunPaths(run)).parent.glob("*/*")
        ]  # freed


def test_a_stop_while_the_tmpfs_is_full_saves_at_once_and_loses_nothing(
    reference: str, root: Path, data: Path, tmp_path: Path
) -> None:
    with small_tmpfs(tmp_path / "shm", "10m") as shm:
        run = _on_a_full_tmpfs(root, "full-tmpfs-stop", data, shm, "testing.step_sleep_s=0.1")
        procs = _start_nodes(run, "a1", ["na", "nb"])
        wait_for(
            lambda: len(_said(run)) == 2, timeout=240, poll=0.1, what="both ranks saying the tier failed"
        )
        rank1 = json.loads((run / "attempts" / "a1" / "rank1.progress.json").read_text())["pid"]
        os.kill(int(rank1), signal.SIGTERM)  # a preemption's signal, reaching one rank
        done = _ended(procs)
        assert all(p.returncode == 0 for p in done), [p.stdout[-3000:] for p in done]
        stopped = h.outcome(run)
        assert stopped["status"] == "stopped" and stopped["step"] < 60, stopped
        saved = [e["step"] for e in h.events(run) if e["event"] == "checkpoint_saved"]
        assert saved[-1] == stopped["step"], saved  # the stop's own save, not one before it
        second = _nodes(run, "a2", ["na", "nb"])
        assert all(p.returncode == 0 for p in second), [p.stdout[-3000:] for p in second]
        assert h.outcome(run, "a2")["params_sha256"] == reference
