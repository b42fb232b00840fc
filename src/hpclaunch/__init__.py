"""hpclaunch: one YAML file to a SLURM/PBS training run (the built-in MMDiT trainer, or your own
torch script) that survives time limits, preemption, crashes, hangs and dead nodes.

A training script adds ``run = hpclaunch.attach(model=..., optimizer=...)`` and
``for step in run.steps(total=N)`` (``hpclaunch.rank``; docs/byo.md). Importing ``hpclaunch`` itself
imports no torch: the names below load the rank side when first used.
"""

import importlib
from typing import Any

__version__ = "0.1.0"
__all__ = ["Run", "Stopped", "attach"]

# name -> the module that defines it (loaded by name on first use: the rank side imports torch, and
# it reads ``__version__`` from here)
_LAZY = {"attach": "hpclaunch.rank.attach", "Run": "hpclaunch.rank.run", "Stopped": "hpclaunch.rank.run"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hpclaunch' has no attribute {name!r}")
