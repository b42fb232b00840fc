"""Stragglers: a rank whose own work per step exceeds the fastest rank's, summary after summary.

Every rank appends a step-time summary every ``watchdog.straggler_every`` steps to
``RUN/steptimes/rank<r>.jsonl`` (``rank.progress``); the ranks step in lockstep, so the summaries
of one step line up. Node 0's watchdog feeds them to a ``StragglerTracker``: once every rank has
summarised a step, each rank's ``work_s`` (own work: CPU time on CPU ranks, host time outside
waits on GPU ranks) is compared with the fastest rank's; a rank slower by more than
``straggler_threshold`` in ``straggler_windows`` summaries in a row is reported once per attempt
(a ``straggler`` ledger event, which ``status`` shows with its node). Wall time cannot be compared:
the collectives make every rank's step as long as the slowest one's.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

# Differences below this are noise whatever the ratio (a tiny model's step is a few milliseconds).
MIN_GAP_S = 0.002


@dataclass(frozen=True)
class Straggler:
    rank: int
    rank_node: str  # the node it runs on (the ledger's own "node" is the writer's)
    attempt: str
    step: int  # the summary that made it a straggler
    work_s: float  # its own work per step (mean over the summary)
    fastest_s: float
    fastest_rank: int
    ratio: float | None  # work_s / fastest_s (None: the fastest did no measurable work)
    windows: int  # slow summaries in a row

    def fields(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        return (
            f"rank {self.rank} on {self.rank_node} is a straggler: {self.work_s * 1000:.1f} ms of own work per step, "
            f"{self.ratio or float('inf'):.2f}x the fastest (rank {self.fastest_rank}), {self.windows} summaries in a row "
            f"up to step {self.step}"
        )


class StragglerTracker:
    def __init__(self, *, world_size: int, threshold: float, windows: int, attempt: str):
        self.world_size = world_size
        self.threshold = threshold
        self.windows = windows
        self.attempt = attempt
        self._by_step: dict[int, dict[int, Mapping[str, Any]]] = {}
        self._streak: dict[int, int] = {}
        self._reported: set[int] = set()

    def feed(self, lines: Iterable[Mapping[str, Any]]) -> list[Straggler]:
        """Take new summary lines (any rank, any order); return the stragglers found by them."""
        for line in lines:
            if line.get("attempt") != self.attempt or not isinstance(line.get("work_s"), (int, float)):
                continue
            self._by_step.setdefault(int(line["step"]), {})[int(line["rank"])] = line
        found: list[Straggler] = []
        for step in sorted(self._by_step):
            if len(self._by_step[step]) >= self.world_size:
                found += self._judge(step, self._by_step.pop(step))
        return found

    def _judge(self, step: int, summaries: Mapping[int, Mapping[str, Any]]) -> list[Straggler]:
        fastest_rank = min(summaries, key=lambda r: float(summaries[r]["work_s"]))
        fastest = float(summaries[fastest_rank]["work_s"])
        found = []
        for rank, line in sorted(summaries.items()):
            work = float(line["work_s"])
            slow = work - fastest > max(MIN_GAP_S, self.threshold * fastest)
            self._streak[rank] = self._streak.get(rank, 0) + 1 if slow else 0
            if self._streak[rank] >= self.windows and rank not in self._reported:
                self._reported.add(rank)
                found.append(
                    Straggler(
                        rank=rank,
                        rank_node=str(line.get("node") or "?"),
                        attempt=self.attempt,
                        step=step,
                        work_s=round(work, 6),
                        fastest_s=round(fastest, 6),
                        fastest_rank=fastest_rank,
                        ratio=round(work / fastest, 3) if fastest > 0 else None,
                        windows=self._streak[rank],
                    )
                )
        return found
