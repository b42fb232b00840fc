"""The memory tier's restore, collective over the roster: what every node holds, one plan that
every rank computes alike (``buddies.plan_restore``), then each rank's shard (mapped on its node,
or pulled from the node that holds it) checked whole on every rank before any is copied."""

from __future__ import annotations

from typing import Any

from ...rundir.shm import TierPlaceError
from ..dist import DistContext, all_gather_json
from . import shard
from .buddies import RestorePlan, plan_restore
from .shard import State
from .store import HeldShard, NodeStore
from .transfer import FAILURES, exchange_pulls, open_sends

__all__ = ["fill_from_plan", "gather_plan", "words_of"]


def gather_plan(
    store: NodeStore | None, ctx: DistContext, node: str, disk_step: int | None, group: Any
) -> tuple[RestorePlan, int | None]:
    """Collective: every node's holdings (one rank per node says them: the others would repeat
    it) and rank 0's newest checkpoint on disk; the plan, and that step."""
    held = store.holdings() if ctx.local_rank == 0 and store is not None else {}
    report = {
        "node": node,
        "disk": disk_step if ctx.is_main else None,
        "holds": [
            [s, w, r, n, m]
            for s, worlds in held.items()
            for w, ranks in worlds.items()
            for r, (n, m) in ranks.items()
        ],
    }
    reports = all_gather_json(report, group)
    on_disk: int | None = reports[0]["disk"]
    holdings: dict[str, dict[int, dict[int, dict[int, tuple[int, int]]]]] = {}
    for r in reports:
        node_holds = holdings.setdefault(r["node"], {})
        for s, w, rank, n, m in r["holds"]:
            node_holds.setdefault(s, {}).setdefault(w, {})[rank] = (n, m)
    return plan_restore([r["node"] for r in reports], holdings, on_disk), on_disk


def fill_from_plan(
    state: State,
    plan: RestorePlan,
    store: NodeStore | None,
    ctx: DistContext,
    expect: dict[str, Any],
    group: Any,
) -> set[str] | str:
    """Collective: this rank's shard (mapped here, or pulled), checked whole on every rank against
    ``expect`` (its step, rank, world size and hashes), then copied into ``state``; the sections
    filled, or the reason when any rank's cannot serve (nothing is copied then, on any rank). Every
    failure is agreed on before the next collective, so no rank waits on one that gave up."""
    assert plan.step is not None
    step, world, rank = plan.step, ctx.world_size, ctx.rank
    sends: list[HeldShard] = []
    local: HeldShard | None = None
    why: str | None = None
    try:
        if store is None:
            raise OSError("this node's tier has no place")
        sends = open_sends(plan.pulls, store, step, world, rank)
        if not any(p.receiver == rank for p in plan.pulls):
            local = store.open(step, world, rank)
    except FAILURES as e:
        why = f"rank {rank}'s node cannot read the snapshot of step {step}: {words_of(e)}"
    try:
        first = _first(all_gather_json(why, group))
        if first is not None:
            return first
        pulled = exchange_pulls(plan.pulls, sends, rank, group)
        for h in sends:
            h.close()
        meta, payload = pulled if pulled is not None else (local.meta, local.payload())  # type: ignore[union-attr]
        checked = shard.check(state, meta, payload, expect)
        why = f"rank {rank}'s snapshot of step {step}: {checked}" if isinstance(checked, str) else None
        first = _first(all_gather_json(why, group))
        if first is not None:
            return first
        assert not isinstance(checked, str)
        return shard.fill(state, checked)
    finally:
        for h in sends:
            h.close()
        if local is not None:
            local.close()


def words_of(e: BaseException) -> str:
    return e.one_line() if isinstance(e, TierPlaceError) else str(e)


def _first(whys: list[Any]) -> str | None:
    return next((w for w in whys if w is not None), None)
