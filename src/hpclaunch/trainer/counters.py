"""The loop's counters: the step, the data position and the NaN guard's tallies.

With the model, the optimizer and the EMA they are all the state one step hands the next (see
``loop``); a checkpoint holds them as int64 tensors (``train``). One ``Counters`` object lives as
long as its trainer: a resume loads into it, so the parts that read it (``saving``, ``reports``)
can hold it from the start.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields

import torch

__all__ = ["Counters"]


@dataclass
class Counters:
    step: int = 0  # optimizer steps completed (skipped ones included)
    samples_consumed: int = 0  # global data position
    nonfinite_consecutive: int = 0
    skipped_total: int = 0

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The checkpoint's ``train`` section: the counters as int64 tensors."""
        return {k: torch.tensor(v, dtype=torch.int64) for k, v in asdict(self).items()}

    def load_state_dict(self, saved: Mapping[str, torch.Tensor]) -> None:
        """Take the counters a checkpoint held (its ``train`` section), in place."""
        loaded = Counters(**{k: int(v) for k, v in saved.items()})
        for f in fields(self):
            setattr(self, f.name, getattr(loaded, f.name))
