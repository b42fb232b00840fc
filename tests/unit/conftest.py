"""Fixtures shared by the unit tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

# What torchrun or a scheduler may have left in the environment that would make an in-process
# Trainer think it is one rank of several, or that its job ends soon.
_DIST_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "HPCLAUNCH_ATTEMPT_CLOCK")


@pytest.fixture
def in_process_trainer(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A Trainer run in the test's own process: a single process, no deadline, and determinism
    switched back off afterwards (the trainer turns it on for the whole process)."""
    import torch

    for name in _DIST_VARS:
        monkeypatch.delenv(name, raising=False)
    yield
    torch.use_deterministic_algorithms(False)
