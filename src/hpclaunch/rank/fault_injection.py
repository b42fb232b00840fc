"""Faults injected for tests and demos (``testing.hang``, ``testing.slow_rank``): never the math.

The progress reporter calls ``on_phase`` at every phase change of this rank. A hang makes the rank
stop forever on entering its phase (of its step, when given): the main thread sleeps in
``hang_forever``, which is the function the watchdog's stack dump must name. Each hang fires once
per run (a marker file in ``RUN/attempts``), so the continuation after it trains on. A slow rank
burns CPU in every step's data phase: its own work per step grows, as on a rank with a slow CPU or
data pipeline, and the other ranks wait for it in their collectives.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from ..config import HangKnob, TestingConfig
from ..rundir import RunPaths


class TestFaults:
    __test__ = False  # not a pytest class

    def __init__(self, hangs: list[tuple[int, HangKnob]], slow_s: float, rank: int, markers: Path):
        self.hangs = hangs  # (index in testing.hang, knob) of this rank
        self.slow_s = slow_s
        self.rank = rank
        self.markers = markers
        self._slowed_step = -1

    @classmethod
    def from_config(cls, testing: TestingConfig, paths: RunPaths, rank: int) -> TestFaults | None:
        hangs = [(i, h) for i, h in enumerate(testing.hang) if h.rank == rank]
        slow = testing.slow_rank
        slow_s = slow.seconds if slow is not None and slow.rank == rank else 0.0
        if not hangs and not slow_s:
            return None
        return cls(hangs, slow_s, rank, paths.attempts)

    def on_phase(self, phase: str, step: int) -> None:
        if self.slow_s and phase == "data" and step != self._slowed_step:
            self._slowed_step = step
            burn_cpu(self.slow_s)
        for index, knob in self.hangs:
            if knob.phase == phase and knob.step in (None, step) and self._first_time(index):
                where = f"{phase}" + (f" at step {step}" if knob.step is not None else "")
                hang_forever(f"testing.hang[{index}]: rank {self.rank} hangs in {where}")

    def _first_time(self, index: int) -> bool:
        self.markers.mkdir(parents=True, exist_ok=True)
        try:
            os.close(os.open(self.markers / f"testing-hang-{index}.fired", os.O_CREAT | os.O_EXCL, 0o644))
        except FileExistsError:
            return False
        return True


def hang_forever(why: str) -> None:
    """Never return (the stop protocol's signal handlers still only set flags)."""
    print(f"hpclaunch: {why}", file=sys.stderr, flush=True)
    while True:
        time.sleep(1.0)


def burn_cpu(seconds: float) -> None:
    """Use ``seconds`` of this thread's CPU time (wall time may be longer on a busy machine)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass
