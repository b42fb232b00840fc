"""The memory tier's buddies and restore plans (pure), one node's snapshot files, and a shard filled
back into a live state: what a restore reads and from where, without a process or a group."""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch

from hpclaunch.rank.checkpoint.staging import SharedStager
from hpclaunch.rank.snapshots import shard
from hpclaunch.rank.snapshots.buddies import buddy_of, plan_restore, ward_of
from hpclaunch.rank.snapshots.store import NodeStore, describe_json
from hpclaunch.rundir.shm import sweep, user_root

pytestmark = pytest.mark.fast


def test_every_buddy_is_on_another_node_and_every_rank_is_someones_ward() -> None:
    for nodes, per in [(2, 2), (3, 2), (4, 8), (512, 8)]:
        world = nodes * per
        buddies = [buddy_of(r, per, world) for r in range(world)]
        assert all(b is not None and b // per != r // per for r, b in enumerate(buddies))
        assert sorted(b for b in buddies if b is not None) == list(range(world))  # a permutation
        assert all(ward_of(b, per, world) == r for r, b in enumerate(buddies) if b is not None)
    assert buddy_of(1, 2, 2) is None and ward_of(0, 4, 4) is None  # one node: no peer


def held(
    *steps: int, ranks: range, world: int = 4, size: int = 100
) -> dict[int, dict[int, dict[int, tuple[int, int]]]]:
    return {s: {world: {r: (size, 10) for r in ranks}} for s in steps}


def merged(
    *parts: dict[int, dict[int, dict[int, tuple[int, int]]]],
) -> dict[int, dict[int, dict[int, tuple[int, int]]]]:
    out: dict[int, dict[int, dict[int, tuple[int, int]]]] = {}
    for p in parts:
        for s, worlds in p.items():
            for w, ranks in worlds.items():
                out.setdefault(s, {}).setdefault(w, {}).update(ranks)
    return out


# Two training nodes (ranks 0-1 on n1, 2-3 on n2): each node holds its own ranks' shards and its
# ward's (n1 keeps n2's ranks, n2 keeps n1's).
N1 = merged(held(30, 35, ranks=range(0, 2)), held(30, 35, ranks=range(2, 4)))
N2 = merged(held(30, 35, ranks=range(2, 4)), held(30, 35, ranks=range(0, 2)))


def test_in_place_every_rank_reads_its_own_node_the_newest_whole_snapshot() -> None:
    plan = plan_restore(["n1", "n1", "n2", "n2"], {"n1": N1, "n2": N2}, disk_step=20)
    assert plan.step == 35 and plan.pulls == ()
    assert plan.shards_from() == {"n1": [0, 1], "n2": [2, 3]}


def test_a_dead_nodes_shards_are_pulled_by_the_spare_from_the_buddy() -> None:
    # n1 died with its memory; the spare n3 runs ranks 0-1 and holds nothing yet.
    plan = plan_restore(["n3", "n3", "n2", "n2"], {"n1": N1, "n2": N2, "n3": {}}, disk_step=20)
    assert plan.step == 35
    assert [(p.shard, p.source, p.sender, p.receiver) for p in plan.pulls] == [
        (0, "n2", 2, 0),
        (1, "n2", 2, 1),
    ]
    assert plan.shards_from() == {"n2": [0, 1, 2, 3]}


def test_a_snapshot_missing_one_shard_everywhere_is_never_restored() -> None:
    # rank 1 died while sending step 35: neither its own copy nor its buddy's was published
    n1 = merged(held(30, ranks=range(0, 4)), held(35, ranks=range(0, 1)), held(35, ranks=range(2, 4)))
    n2 = merged(held(30, ranks=range(0, 4)), held(35, ranks=range(2, 4)), held(35, ranks=range(0, 1)))
    plan = plan_restore(["n1", "n1", "n2", "n2"], {"n1": n1, "n2": n2}, disk_step=20)
    assert plan.step == 30
    none = plan_restore(["n1", "n1", "n2", "n2"], {"n1": n1, "n2": n2}, disk_step=30)
    assert none.step is None and "no whole snapshot: step 35 misses rank 1's shard" in none.reason
    assert "the disk's step 30 serves" in none.reason


def test_the_disk_the_world_size_and_a_buddy_that_died_too_say_why() -> None:
    hosts = ["n1", "n1", "n2", "n2"]
    assert (
        plan_restore(hosts, {"n1": N1, "n2": N2}, disk_step=40).reason
        == "no snapshot newer than the disk's step 40"
    )
    assert plan_restore(hosts, {}, disk_step=None).reason == "no snapshot in memory on this attempt's nodes"
    other = {"n1": held(35, ranks=range(0, 2), world=2)}
    assert "taken at world size 2, not 4" in plan_restore(hosts, other, disk_step=None).reason
    # both n1 and its buddy n2 gone (replaced by n3 and n4): nothing left of ranks 0-3
    gone = plan_restore(["n3", "n3", "n4", "n4"], {"n1": N1, "n2": N2}, disk_step=None)
    assert gone.step is None and gone.reason == "no snapshot in memory on this attempt's nodes"


def test_at_512_nodes_a_dead_nodes_ranks_are_pulled_from_the_next_node() -> None:
    nodes, per = 512, 8
    world = nodes * per
    holdings: dict[str, dict[int, dict[int, dict[int, tuple[int, int]]]]] = {}
    for n in range(nodes):  # each node: its own ranks and its ward's (the previous node's), 3 steps
        ward = range(((n - 1) % nodes) * per, ((n - 1) % nodes) * per + per)
        holdings[f"n{n}"] = merged(held(25, 30, 35, ranks=range(n * per, n * per + per), world=world),
                                   held(25, 30, 35, ranks=ward, world=world))  # fmt: skip
    hosts = [f"n{r // per}" for r in range(world)]
    hosts[17 * per : 18 * per] = ["spare"] * per  # node 17 died; the spare runs its ranks
    plan = plan_restore(hosts, holdings, disk_step=20)
    assert plan.step == 35
    assert [(p.shard, p.source, p.sender) for p in plan.pulls] == [
        (r, "n18", 18 * per) for r in range(136, 144)
    ]
    assert all(buddy_of(r, per, world) // per == 18 for r in range(136, 144))


def _store(base: Path, allocation: str = "123.0") -> NodeStore:
    return NodeStore(user_root(base) / "run", base, "n1", allocation)


def _meta(nbytes: int) -> bytes:
    return describe_json({"nbytes": nbytes})


def test_a_shard_is_held_once_published_and_only_at_its_size(tmp_path: Path) -> None:
    store = _store(tmp_path)
    pending = store.begin(35, 4, 2, 8)
    pending.payload()[:] = b"abcdefgh"
    assert store.holdings() == {}  # not published yet: not held
    pending.publish(_meta(8))
    assert store.holdings() == {35: {4: {2: (8, len(_meta(8)))}}}
    held = store.open(35, 4, 2)
    assert bytes(held.payload()) == b"abcdefgh" and held.meta == _meta(8)
    held.close()
    cut = store.begin(40, 4, 2, 8)
    cut.publish(_meta(8))
    (store.step_dir(40, 4) / "rank-00002.bin").write_bytes(b"abc")  # a payload cut short
    assert 40 not in store.holdings()
    dropped = store.begin(45, 4, 2, 8)
    dropped.drop()
    assert list(store.step_dir(45, 4).iterdir()) == []
    store.prune([2], keep_last=1, step=45)  # the newest step directory is kept, older ones lose rank 2
    assert not store.step_dir(35, 4).exists() and store.step_dir(45, 4).exists()


def test_prune_keeps_the_new_snapshots_after_a_resume_from_an_older_step(tmp_path: Path) -> None:
    """An attempt left snapshots up to 55; the next resumed from the disk's 40: its snapshot of 45 is
    kept (those newer than it are of the timeline the run left), where counting 50 and 55 as the
    newest dropped each new snapshot as soon as it was made."""
    store = _store(tmp_path)
    for step in (50, 55, 45):
        store.begin(step, 2, 0, 1).publish(_meta(1))
        store.prune([0], keep_last=2, step=step)
    assert sorted(store.holdings()) == [45]
    store.begin(50, 2, 0, 1).publish(_meta(1))  # the same number again: made anew, not refused
    store.prune([0], keep_last=2, step=50)
    assert sorted(store.holdings()) == [45, 50]


def test_a_shards_space_is_reserved_before_a_byte_is_written(tmp_path: Path) -> None:
    """``posix_fallocate``: the file holds its blocks from the start (a sparse one, ftruncate's,
    would fail later, inside a write or a receive)."""
    pending = _store(tmp_path).begin(5, 2, 0, 1 << 20)
    st = os.stat(pending.directory / ".rank-00000.bin.tmp")
    assert st.st_size == 1 << 20 and st.st_blocks * 512 >= 1 << 20
    pending.drop()


def test_an_ended_allocations_snapshots_are_never_held_and_are_swept(tmp_path: Path) -> None:
    before = _store(tmp_path, "123.0")  # the job before its requeue (restart count 0)
    before.begin(35, 4, 0, 1).publish(_meta(1))
    now = _store(tmp_path, "123.1")
    assert before.holdings() and now.holdings() == {}
    assert sweep(tmp_path) == []  # both held: their processes live
    before.close(remove=False)  # its process ended without freeing (a crash, a SIGKILL)
    assert sweep(tmp_path) == [before.directory] and not before.directory.exists()
    now.begin(5, 4, 0, 1).publish(_meta(1))
    now.close(remove=True)
    assert not (user_root(tmp_path) / "run").exists()  # the node's and run's go with the last allocation


def _state(seed: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(3, 4, generator=g), "b": torch.randn(4, generator=g)},
        "optim": {"state": {"w": {"step": torch.tensor(float(seed))}}, "param_groups": [{"lr": 0.1 * seed}]},
        "train": {"step": torch.tensor(seed, dtype=torch.int64)},
        "rank_local": {"rank0": {"python_rng": (3, tuple(range(5)), None)}},
    }


def _described(saved: dict[str, object]) -> tuple[bytes, bytes]:
    """(description, payload) of ``saved`` as the job writes them."""
    staged = SharedStager().stage(saved)
    payload = os.pread(staged.layout.fd, staged.layout.nbytes, 0)  # what the job copies into the store
    meta = describe_json(
        shard.describe(
            staged,
            step=35,
            rank=0,
            world_size=2,
            hashes={"model_hash": "m", "config_hash": "c"},
            crc32=zlib.crc32(payload),
        )
    )
    return meta, payload


EXPECT = {"step": 35, "rank": 0, "world_size": 2, "model_hash": "m"}


def test_a_shard_fills_a_live_state_in_place_and_a_misfit_changes_nothing() -> None:
    saved = _state(7)
    meta_bytes, payload = _described(saved)
    meta = json.loads(meta_bytes)
    live = _state(1)
    w = live["model"]["w"]  # type: ignore[index]
    assert shard.misfit(live, meta, EXPECT) is None
    assert (
        shard.misfit(live, meta, {**EXPECT, "model_hash": "other"})
        == "the snapshot's model_hash is 'm', this run's 'other'"
    )
    wrong = _state(1)
    wrong["model"]["w"] = torch.zeros(4, 3)  # type: ignore[index]
    assert "model.w is float32[3, 4] in the snapshot" in (shard.misfit(wrong, meta, EXPECT) or "")
    checked = shard.check(live, meta_bytes, payload, EXPECT)
    assert not isinstance(checked, str)
    sections = shard.fill(live, checked)
    assert sections == {"model", "optim", "train", "rank_local"}
    assert live["model"]["w"] is w and torch.equal(w, saved["model"]["w"])  # type: ignore[index]
    assert live["optim"]["param_groups"][0]["lr"] == pytest.approx(0.7)  # type: ignore[index]
    assert int(live["train"]["step"]) == 7  # type: ignore[index]
    assert tuple(live["rank_local"]["rank0"]["python_rng"][1]) == tuple(range(5))  # type: ignore[index]


def _edited(meta_bytes: bytes, **changes: object) -> bytes:
    return json.dumps({**json.loads(meta_bytes), **changes}).encode()


@pytest.mark.parametrize(
    "damage, said",
    [
        (lambda m, p: (m, p[:-1] + bytes([p[-1] ^ 1])), "checksum differs"),  # one bit of the payload
        (lambda m, p: (m, p[:-64]), "payload is"),  # cut short
        (lambda m, p: (m[:-5], p), "cannot be read: JSONDecodeError"),  # a torn description
        (lambda m, p: (_edited(m, slots="x"), p), "cannot be read"),
        (lambda m, p: (_edited(m, slots=[{"fqn": "model.w"}]), p), "tensors differ"),
        (  # a slot placed outside the payload: never read out of bounds
            lambda m, p: (
                _edited(m, slots=[{**s, "offset": 1 << 30} for s in json.loads(m)["slots"]]),
                p,
            ),
            "lies outside it",
        ),
        (  # a plain value that does not decode
            lambda m, p: (_edited(m, objects={k: "!!" for k in json.loads(m)["objects"]}), p),
            "cannot be read",
        ),
    ],
)
def test_a_damaged_torn_or_foreign_shard_is_a_reason_and_changes_nothing(damage: Any, said: str) -> None:
    """Read by a restore, a shard that does not hold together is a reason (the disk tier serves),
    never an exception that fails the rank on every attempt, and never half copied."""
    meta, payload = damage(*_described(_state(7)))
    live = _state(1)
    before = {k: v.clone() for k, v in live["model"].items()}  # type: ignore[attr-defined]
    why = shard.check(live, meta, payload, EXPECT)
    assert isinstance(why, str) and said in why, why
    assert all(torch.equal(live["model"][k], v) for k, v in before.items())  # type: ignore[index]


def test_the_description_encoded_in_parts_is_the_whole_one() -> None:
    """The layout's part is encoded once per layout (it cost 1.5 ms of every snapshot's job)."""
    staged = SharedStager().stage(_state(7))
    args: dict[str, Any] = {
        "step": 35,
        "rank": 0,
        "world_size": 2,
        "hashes": {"model_hash": "m", "config_hash": "c"},
    }
    for crc in (1, 2):  # the second from the cached part
        whole = json.loads(describe_json(shard.describe(staged, **args, crc32=crc)))
        assert json.loads(shard.describe_bytes(staged, **args, crc32=crc)) == whole
