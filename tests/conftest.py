"""The `fast` tier's guard: a test in it (marked `fast` and not `spawns`: what `make check` runs)
must not start a process or a torch.distributed process group.

A start is refused (tests/spawnguard.py), and the test fails at teardown even where the code under
test caught the refusal: a test that starts a process is marked `spawns` (or its module leaves the
tier); it does not hide in it.

The guard is on where the tier runs alone (`make check` sets HPCLAUNCH_FAST_GUARD=1). In the whole
suite it stays off: the guard patches process starts for every thread, and a helper thread left by
an earlier (spawning) test must not fail a fast test that happens to run beside it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from tests.spawnguard import refusing_processes

pytest_plugins = ["tests.cpu_report"]  # HPCLAUNCH_TEST_CPU_REPORT=FILE: CPU time per module

# ---- parallel workers (`make test`: pytest-xdist) ---------------------------------------------------


def _group_of(nodeid: str) -> str:
    """The worker group a test runs in: every test of one real cluster in one group, one after the
    other (they share its daemons and switch its layout); every other module's tests together
    (its module fixtures are built once)."""
    path = nodeid.split("::", 1)[0]
    if path.startswith("tests/cluster/"):
        return "slurm"
    if path.startswith("tests/pbs/"):
        return "pbs"
    return path


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """Work units of whole groups (above), in collection order. Not `--dist loadgroup`: with
    pytest 9 its `xdist_group` marks no longer reach the scheduler (every test went alone)."""
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _group_of(nodeid)

    return ByGroup(config, log)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In a parallel run's workers (xdist sets `workerinput`), the two clusters' groups first in
    the queue, so that the longest ones start at once and the modules share the other workers
    meanwhile. Runs after the cluster conftests' own ordering by layout, kept within each group."""
    if not hasattr(config, "workerinput"):
        return
    rank = {"slurm": 0, "pbs": 1}
    items.sort(key=lambda it: rank.get(_group_of(it.nodeid), 2))


@pytest.fixture(autouse=True)
def _fast_tests_start_no_process(request: pytest.FixtureRequest) -> Iterator[None]:
    node = request.node
    if (
        os.environ.get("HPCLAUNCH_FAST_GUARD") != "1"
        or node.get_closest_marker("fast") is None
        or node.get_closest_marker("spawns") is not None
    ):
        yield
        return
    with refusing_processes() as tried:
        yield
    if tried:
        pytest.fail(f"a `fast` test started a process ({', '.join(tried)}): mark it `spawns`", pytrace=False)
