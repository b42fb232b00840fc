"""Stragglers: the tracker's rule (threshold, summaries in a row, once per attempt), and what
`status` reads back from the per-rank step-time files and the ledger."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hpclaunch.jobs.straggler_tracker import StragglerTracker
from hpclaunch.orchestrator.stragglers import describe, straggler_summary
from hpclaunch.rundir import Ledger, RunPaths, read_events
from hpclaunch.rundir.progress_files import steptimes_file

pytestmark = pytest.mark.fast


def line(rank: int, step: int, work: float, attempt: str = "j.0") -> dict[str, Any]:
    return {
        "attempt": attempt,
        "rank": rank,
        "node": f"n{rank // 2 + 1}",
        "step": step,
        "work_s": work,
        "ts": step,
    }


def tracker() -> StragglerTracker:
    return StragglerTracker(world_size=4, threshold=0.5, windows=3, attempt="j.0")


def test_a_rank_slow_in_three_summaries_in_a_row_is_reported_once() -> None:
    t = tracker()
    found = []
    for step in (10, 20, 30, 40, 50):
        found += t.feed([line(r, step, 0.030 if r != 3 else 0.080) for r in range(4)])
    assert [(s.rank, s.rank_node, s.step, s.windows) for s in found] == [(3, "n2", 30, 3)]
    assert found[0].ratio == round(0.080 / 0.030, 3) and found[0].fastest_s == 0.030
    assert "rank 3 on n2 is a straggler" in found[0].describe()


def test_a_healthy_spread_and_an_interrupted_streak_are_never_reported() -> None:
    t = tracker()
    found = []
    slow_then_not = [0.08, 0.08, 0.03, 0.08, 0.08, 0.03]  # never three in a row
    for i, work in enumerate(slow_then_not):
        step = 10 * (i + 1)
        # ranks 0-2 differ by 40 % (under the threshold); rank 3 alternates
        found += t.feed(
            [line(0, step, 0.030), line(1, step, 0.042), line(2, step, 0.035), line(3, step, work)]
        )
    assert found == []


def test_tiny_differences_are_noise_whatever_the_ratio() -> None:
    t = StragglerTracker(world_size=2, threshold=0.5, windows=1, attempt="j.0")
    assert t.feed([line(0, 5, 0.0010), line(1, 5, 0.0025)]) == []  # 2.5x, but 1.5 ms


def test_summaries_wait_for_every_rank_and_other_attempts_are_ignored() -> None:
    t = StragglerTracker(world_size=2, threshold=0.5, windows=1, attempt="j.1")
    assert t.feed([line(0, 10, 0.03, "j.0"), line(1, 10, 0.09, "j.0")]) == []
    assert t.feed([line(1, 10, 0.09, "j.1")]) == []  # rank 0's summary of step 10 is not in yet
    assert [s.rank for s in t.feed([line(0, 10, 0.03, "j.1")])] == [1]


def test_status_names_the_slowest_rank_and_the_reported_stragglers(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path).ensure()
    assert straggler_summary(paths, []).slowest is None and describe(straggler_summary(paths, [])) is None
    for rank, work in ((0, 0.030), (1, 0.081)):
        path = steptimes_file(paths, rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        old = line(rank, 10, 0.5, attempt="j.0")  # an earlier attempt's summary
        path.write_text("\n".join(json.dumps(x) for x in (old, line(rank, 40, work, attempt="j.1"))) + "\n")
    healthy = straggler_summary(paths, [])
    slowest = healthy.slowest
    assert slowest is not None and slowest.rank == 1 and slowest.node == "n1"
    assert slowest.ratio == 2.7 and healthy.reported == []
    assert describe(healthy) is not None and "no stragglers" in str(describe(healthy))
    tracked = StragglerTracker(world_size=2, threshold=0.5, windows=1, attempt="j.1")
    found = tracked.feed([line(0, 40, 0.030, "j.1"), line(1, 40, 0.081, "j.1")])
    Ledger(paths, role="agent", attempt="j.1", node=0).append("straggler", **found[0].fields())
    summary = straggler_summary(paths, read_events(paths).events)
    assert [(r.rank, r.rank_node) for r in summary.reported] == [(1, "n1")]
    text = describe(summary)
    assert text is not None and "slowest rank 1 on n1" in text and "stragglers: rank 1 on n1 (2.70x)" in text
