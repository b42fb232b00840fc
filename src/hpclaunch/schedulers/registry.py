"""Which module answers for a scheduler kind. Above the three scheduler modules (which import
``base``), so that ``base`` imports none of them."""

from __future__ import annotations

from .protocol import Scheduler


def get_scheduler(kind: str) -> Scheduler:
    if kind == "slurm":
        from .slurm import SlurmScheduler

        return SlurmScheduler()
    if kind == "pbs":
        from .pbs import PbsScheduler

        return PbsScheduler()
    if kind == "local":
        from .local import LocalScheduler

        return LocalScheduler()
    raise ValueError(f"unknown scheduler {kind!r}")
