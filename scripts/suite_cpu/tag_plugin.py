"""pytest plugin for scripts/suite-cpu: each test's processes carry its module's tag.

Sets ``HPCLAUNCH_PROCNAME`` to a 4-character code of the test's module while the test runs; every
process the test starts inherits it (CLI calls, the local scheduler's jobs, SLURM's, torchrun's),
and ``name_process.pth`` names each Python process ``<code>:<module>`` at its start, which the
kernel's process accounting records at its exit. The codes and their modules go to
``$SUITE_CPU_MAP``. Not part of the test suite: loaded only by scripts/suite-cpu."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator

import pytest


def module_code(module: str) -> str:
    return hashlib.sha1(module.encode()).hexdigest()[:4]


@pytest.fixture(autouse=True)
def _tag_processes_with_the_module(request: pytest.FixtureRequest) -> Iterator[None]:
    mapping = os.environ.get("SUITE_CPU_MAP")
    if not mapping:
        yield
        return
    module = request.node.nodeid.split("::", 1)[0]
    code = module_code(module)
    with open(mapping, "a") as out:
        out.write(f"{code} {module}\n")
    before = os.environ.get("HPCLAUNCH_PROCNAME", "")
    os.environ["HPCLAUNCH_PROCNAME"] = code + ":"
    try:
        yield
    finally:
        os.environ["HPCLAUNCH_PROCNAME"] = before
