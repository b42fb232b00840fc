"""The `fast` tier's guard: a test in it (marked `fast` and not `spawns`: what `make check` runs)
must not start a process or a torch.distributed process group.

A start is refused (tests/spawnguard.py), and the test fails at teardown even where the code under
test caught the refusal: a test that starts a process is marked `spawns` (or its module leaves the
tier); it does not hide in it.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from tests.spawnguard import refusing_processes


@pytest.fixture(autouse=True)
def _fast_tests_start_no_process(request: pytest.FixtureRequest) -> Iterator[None]:
    node = request.node
    if node.get_closest_marker("fast") is None or node.get_closest_marker("spawns") is not None:
        yield
        return
    with refusing_processes() as tried:
        yield
    if tried:
        pytest.fail(f"a `fast` test started a process ({', '.join(tried)}): mark it `spawns`", pytrace=False)
