"""Issue 49, L1: snapshots of two timelines restored together at one step. Timeline A snapshots
step 100 on both ranks of a node; the run resumes from the disk's step 80 (timeline B); B's step 100
is written by rank 0 and fails on rank 1 (a full tmpfs); the next restore found step 100 whole:
rank 0's shard of B beside rank 1's of A. A resume now forgets every snapshot newer than the step it
resumed from, on every node, before any rank writes again (``NodeStore.forget_after``, called by
``MemoryTier.restore``). Real files in a private tmpfs-like directory; the plan is the real one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpclaunch.rank.snapshots.buddies import plan_restore
from hpclaunch.rank.snapshots.store import NodeStore
from hpclaunch.rundir.shm import user_root

pytestmark = pytest.mark.fast

WORLD = 2


def snapshot(store: NodeStore, step: int, rank: int, timeline: str) -> None:
    shard = store.begin(step, WORLD, rank, 8)
    shard.payload()[:] = timeline.encode().ljust(8)[:8]
    shard.publish(json.dumps({"nbytes": 8, "timeline": timeline}).encode())


def test_a_resume_forgets_the_left_timelines_snapshots_so_none_is_joined_to_the_new_ones(
    tmp_path: Path,
) -> None:
    base = tmp_path / "shm"
    base.mkdir()
    store = NodeStore(user_root(base) / "run", base, "n1", "7.0")
    for rank in range(WORLD):
        snapshot(store, 100, rank, "A")
    assert plan_restore(["n1", "n1"], {"n1": store.holdings()}, disk_step=80).step == 100
    # a resume from the disk's step 80 (A's step 100 was not restored: another node lost its copy)
    store.forget_after(None)
    snapshot(store, 90, 0, "B")
    snapshot(store, 90, 1, "B")
    snapshot(store, 100, 0, "B")  # rank 1's write of step 100 fails: nothing of it
    plan = plan_restore(["n1", "n1"], {"n1": store.holdings()}, disk_step=80)
    assert plan.step == 90, plan  # B's last whole step, never A's rank 1 beside B's rank 0
    # a resume from memory at 90: what is newer is forgotten, 90 kept
    store.forget_after(90)
    assert sorted(store.holdings()) == [90]
    store.close(remove=True)
