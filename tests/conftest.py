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
