"""Refuse to start a process: the guard of the `fast` tier (tests/conftest.py applies it).

Every way the test suite could start a process ends in one of the functions replaced here:
subprocess and multiprocessing's spawn and forkserver go through ``_posixsubprocess.fork_exec``;
multiprocessing's fork, DataLoader workers and ``os.system`` through ``os.fork`` or
``os.posix_spawn``. torch.distributed's ``init_process_group`` is refused too where torch is loaded.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

_OS_STARTERS = ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system")


class SpawnInFastTest(BaseException):
    """Raised where a `fast` test starts a process (a BaseException, so ``except Exception`` in the
    code under test does not swallow it)."""


@contextlib.contextmanager
def refusing_processes() -> Iterator[list[str]]:
    """Within the block every process start raises ``SpawnInFastTest``; the list it yields names
    each one tried, so a caller sees them even where the code under test caught the refusal."""
    tried: list[str] = []

    def refuse(what: str) -> Any:
        def starter(*args: Any, **kwargs: Any) -> Any:
            tried.append(what)
            raise SpawnInFastTest(f"a `fast` test started a process ({what}): mark it `spawns`")

        return starter

    import _posixsubprocess

    with pytest.MonkeyPatch.context() as mp:
        for name in _OS_STARTERS:
            if hasattr(os, name):
                mp.setattr(os, name, refuse(f"os.{name}"))
        mp.setattr(_posixsubprocess, "fork_exec", refuse("_posixsubprocess.fork_exec"))
        if getattr(subprocess, "_fork_exec", None) is not None:
            mp.setattr(subprocess, "_fork_exec", refuse("subprocess"))
        dist = sys.modules.get("torch.distributed")
        if dist is not None and hasattr(dist, "init_process_group"):
            mp.setattr(dist, "init_process_group", refuse("torch.distributed.init_process_group"))
        yield tried
