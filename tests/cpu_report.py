"""Where the suite's CPU time goes, per test module: `HPCLAUNCH_TEST_CPU_REPORT=FILE pytest ...`.

The suite is CPU-bound on a 2-core machine: its time is set by the core-seconds it burns (torch
imports of every process an attempt starts, training steps, saves) as much as by its wall-clock
waits. This plugin reads the machine's busy CPU time (/proc/stat, every process: the ranks that
SLURM's and OpenPBS's daemons start are not this process's children) before and after each test
and writes one row per module: its tests, wall seconds, CPU core-seconds. Run it in one process
(`make test-serial` or a plain `pytest`), on an otherwise quiet machine: under pytest-xdist, or
beside other work, every row also counts what ran beside it. Off unless the variable is set.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest

ENV = "HPCLAUNCH_TEST_CPU_REPORT"
_rows: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])


def busy_seconds() -> float:
    """Core-seconds every CPU of the machine has spent not idle, since boot."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields) - idle) / os.sysconf("SC_CLK_TCK")


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get(ENV) and getattr(config.option, "numprocesses", None):
        # each worker would count the others' CPU as its own, and the controller runs no test
        raise pytest.UsageError(f"{ENV} needs one process: drop -n (use `make test-serial`'s pytest)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    if not os.environ.get(ENV):
        yield
        return
    cpu, wall = busy_seconds(), time.monotonic()
    yield
    row = _rows[item.nodeid.split("::", 1)[0]]
    row[0] += 1
    row[1] += time.monotonic() - wall
    row[2] += busy_seconds() - cpu


def pytest_sessionfinish(session: pytest.Session) -> None:
    target = os.environ.get(ENV)
    if not target or not _rows:
        return
    lines = ["module\ttests\twall_s\tcpu_core_s"]
    for module, (n, wall, cpu) in sorted(_rows.items(), key=lambda kv: -kv[1][2]):
        lines.append(f"{module}\t{n:.0f}\t{wall:.1f}\t{cpu:.1f}")
    Path(target).write_text("\n".join(lines) + "\n")
