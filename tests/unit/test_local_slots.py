"""The local scheduler keeps scheduler.array_parallelism: a sweep's points take turns, in order."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hpclaunch.schedulers.local_slots import may_start, sweep_points

pytestmark = pytest.mark.fast


def _sweep(root: Path, n: int) -> list[Path]:
    points = [root / f"p{i}" for i in range(n)]
    root.mkdir()
    (root / "sweep.json").write_text(json.dumps({"points": [{"run_dir": str(p)} for p in points]}))
    return points


def test_a_point_waits_while_the_slots_are_taken_and_earlier_points_go_first(tmp_path: Path) -> None:
    p0, p1, p2 = _sweep(tmp_path / "sw", 3)
    states: dict[Path, dict[str, Any]] = {}

    def start(point: Path, parallelism: int) -> bool:
        return may_start(point, parallelism, lambda p: states.get(p.resolve(), {}), lambda pid: pid > 0)

    assert sweep_points(p1) == [p0.resolve(), p1.resolve(), p2.resolve()]
    states[p0.resolve()] = {"state": "running", "pid": 10}
    assert not start(p1, 1) and start(p1, 2)
    states[p1.resolve()] = {"state": "held", "slot": True, "pid": 11}
    states[p0.resolve()] = {"state": "completed", "pid": 10}  # p0 ended: one slot free ...
    assert start(p1, 1) and not start(p2, 1)  # ... and p1, waiting before p2, takes it
    states[p1.resolve()] = {"state": "running", "pid": 11}
    assert not start(p2, 1)
    states[p1.resolve()] = {"state": "running", "pid": 0}  # its controller died: it holds no slot
    assert start(p2, 1)


def test_a_run_that_is_no_sweep_point_never_waits(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    assert may_start(tmp_path / "run", 1, lambda p: {"state": "running", "pid": 1}, lambda pid: True)
