"""Buddies and restore plans: pure functions of the roster and of what each node holds.

Ranks are laid out node by node (node ``n`` runs ranks ``n*p .. n*p+p-1``), and a node's place in
the roster is a role: a hot spare that replaces node ``n`` runs node ``n``'s ranks. Rank ``r``'s buddy
is the same local rank on the next node, so every node sends ``p`` shards to one peer and keeps ``p``
for another, and no buddy is ever on its own node.

At a restore every rank reports its node and what that node holds; every rank then computes the same
plan from the same report (one ``all_gather``, no leader): the newest step newer than the disk's at
which every rank's shard is held by some node of the current roster. A rank whose own node holds its
shard reads it there; any other (the spare's ranks, after a node died with its memory) is sent it by
the lowest rank of a node that holds it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

# what a node holds: step -> world size -> rank -> (payload bytes, description bytes)
Holdings = Mapping[int, Mapping[int, Mapping[int, tuple[int, int]]]]


def buddy_of(rank: int, ranks_per_node: int, world_size: int) -> int | None:
    """The rank on the next node that keeps a copy of ``rank``'s snapshots (None on one node)."""
    if world_size // ranks_per_node < 2:
        return None
    return (rank + ranks_per_node) % world_size


def ward_of(rank: int, ranks_per_node: int, world_size: int) -> int | None:
    """The rank whose copies ``rank`` keeps (the one whose buddy it is)."""
    if world_size // ranks_per_node < 2:
        return None
    return (rank - ranks_per_node) % world_size


@dataclass(frozen=True)
class Pull:
    """Rank ``shard``'s snapshot, sent by ``sender`` (on ``source``) to ``receiver``."""

    shard: int
    source: str
    sender: int
    receiver: int
    nbytes: int
    meta_bytes: int


@dataclass(frozen=True)
class RestorePlan:
    """The snapshot to restore (``step`` None: none; ``reason`` says why, in the user's words)."""

    step: int | None
    reason: str = ""
    served_by: dict[int, str] = field(default_factory=dict)  # shard (rank) -> the node that serves it
    pulls: tuple[Pull, ...] = ()

    def shards_from(self) -> dict[str, list[int]]:
        """node -> the ranks whose shards it served (what the ledger records)."""
        out: dict[str, list[int]] = {}
        for rank, node in sorted(self.served_by.items()):
            out.setdefault(node, []).append(rank)
        return out


def plan_restore(
    hosts: Sequence[str], holdings: Mapping[str, Holdings], disk_step: int | None
) -> RestorePlan:
    """The newest snapshot newer than ``disk_step`` that the roster ``hosts`` (rank -> its node now)
    holds whole at this world size, and the pulls it needs. ``holdings``: node -> what it holds."""
    world = len(hosts)
    roster = sorted(set(hosts))
    # step -> rank -> the nodes of the roster that hold its shard (a node that left serves nothing);
    # one pass over what is held, so a plan at 512 nodes costs what they hold, not nodes x ranks
    holders: dict[int, dict[int, list[str]]] = {}
    other_worlds: set[int] = set()
    for h in roster:
        for step, worlds in holdings.get(h, {}).items():
            other_worlds.update(w for w in worlds if w != world)
            for rank in worlds.get(world, {}):
                holders.setdefault(step, {}).setdefault(rank, []).append(h)
    if not holders:
        if other_worlds:
            return RestorePlan(
                None, f"the snapshots were taken at world size {max(other_worlds)}, not {world}"
            )
        return RestorePlan(None, "no snapshot in memory on this attempt's nodes")
    newer = sorted((s for s in holders if disk_step is None or s > disk_step), reverse=True)
    if not newer:
        return RestorePlan(None, f"no snapshot newer than the disk's step {disk_step}")
    missing_text = ""
    for step in newer:
        missing = next((r for r in range(world) if r not in holders[step]), None)
        if missing is not None:
            missing_text = missing_text or f"step {step} misses rank {missing}'s shard on every node left"
            continue
        return _plan_for(step, world, hosts, holdings, holders[step])
    older = f"; the disk's step {disk_step} serves" if disk_step is not None else ""
    return RestorePlan(None, f"no whole snapshot: {missing_text}{older}")


def _plan_for(
    step: int,
    world: int,
    hosts: Sequence[str],
    held: Mapping[str, Holdings],  # (every node's, roster or not: only the roster's are in holders)
    holders: Mapping[int, list[str]],
) -> RestorePlan:
    served: dict[int, str] = {}
    pulls: list[Pull] = []
    first_rank: dict[str, int] = {}
    for r, h in enumerate(hosts):
        first_rank.setdefault(h, r)
    for rank in range(world):
        if hosts[rank] in holders[rank]:
            served[rank] = hosts[rank]
            continue
        source = holders[rank][0]
        nbytes, meta_bytes = held[source][step][world][rank]
        served[rank] = source
        pulls.append(Pull(rank, source, first_rank[source], rank, nbytes, meta_bytes))
    return RestorePlan(step, served_by=served, pulls=tuple(pulls))
