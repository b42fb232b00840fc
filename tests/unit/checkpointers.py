"""Checkpointers for tests from the flat keywords the tests name (rank, world size, hashes,
retention, writer settings): split here into the records ``Checkpointer`` takes, so each test
overrides one setting by name."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from hpclaunch.rank.checkpoint import Checkpointer, RunCheckpoints, WriterSettings

# The config's names of the writer settings (checkpoint.writer_nice ...) -> WriterSettings' fields.
_WRITER_KEYS = {"async_save": "async_save", "writer": "writer", "writer_nice": "nice"}
_WRITER_KEYS |= {"writer_idle": "idle", "write_threads": "write_threads"}


def checkpointer(directory: Path, **kw: Any) -> Checkpointer:
    """``Checkpointer`` at ``directory``; ``kw``: ``rank``, ``ledger``, ``process_group``, the
    fields of ``RunCheckpoints`` and the writer settings by their config names."""
    run_fields = {f.name for f in dataclasses.fields(RunCheckpoints)}
    run = RunCheckpoints(directory, **{k: kw.pop(k) for k in list(kw) if k in run_fields})
    writing = WriterSettings(**{_WRITER_KEYS[k]: kw.pop(k) for k in list(kw) if k in _WRITER_KEYS})
    return Checkpointer(run, writing=writing, **kw)
