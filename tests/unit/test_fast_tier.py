"""The `fast` tier keeps its word: a process start inside it is refused and seen, even where the
code under test catches the refusal (tests/spawnguard.py, applied by tests/conftest.py)."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tests.spawnguard import SpawnInFastTest, refusing_processes

pytestmark = pytest.mark.fast


def test_subprocess_is_refused_past_except_exception_and_seen_even_when_caught() -> None:
    with refusing_processes() as tried:
        # code under test that swallows errors does not swallow this
        with pytest.raises(SpawnInFastTest), contextlib.suppress(Exception):
            subprocess.run([sys.executable, "-c", "pass"], check=False)
        with contextlib.suppress(BaseException):  # nor does code that swallows everything hide it
            subprocess.run([sys.executable, "-c", "pass"], check=False)
    assert tried == ["subprocess", "subprocess"]


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_every_multiprocessing_start_method_is_refused(method: str) -> None:
    with refusing_processes() as tried, pytest.raises(SpawnInFastTest):
        multiprocessing.get_context(method).Process(target=print).start()
    assert tried


def test_os_level_starts_are_refused() -> None:
    with refusing_processes() as tried:
        for start in (os.fork, lambda: os.system("true")):
            with pytest.raises(SpawnInFastTest):
                start()
    assert tried == ["os.fork", "os.system"]


def test_the_tier_is_registered_and_make_check_runs_it() -> None:
    root = Path(__file__).resolve().parents[2]
    assert '"fast and not spawns"' in (root / "Makefile").read_text()
    pyproject = (root / "pyproject.toml").read_text()
    assert '"fast:' in pyproject and '"spawns:' in pyproject
