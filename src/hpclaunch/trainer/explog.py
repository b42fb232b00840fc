"""The experiment logs rank 0 writes besides ``metrics.jsonl``: TensorBoard (``train.tensorboard``)
and Weights & Biases (``train.wandb``), behind one object with TensorBoardLog's three calls, so the
loop logs a window or marks a start or stop once, whatever is on."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from ..config import RunConfig


class ExperimentLog(Protocol):
    def scalars(self, record: dict[str, Any]) -> None: ...

    def mark(self, what: str, step: int, text: str) -> None: ...

    def close(self) -> None: ...


class ExperimentLogs:
    """Every configured experiment log; each call goes to all of them."""

    def __init__(self, logs: list[ExperimentLog]):
        self.logs = logs

    def scalars(self, record: dict[str, Any]) -> None:
        for log in self.logs:
            log.scalars(record)

    def mark(self, what: str, step: int, text: str) -> None:
        for log in self.logs:
            log.mark(what, step, text)

    def close(self) -> None:
        for log in self.logs:
            log.close()


def open_experiment_logs(
    cfg: RunConfig, run_dir: Path, *, attempt: str, resumed_step: int
) -> ExperimentLogs | None:
    """The logs this run's config asks for (None: neither TensorBoard nor W&B)."""
    logs: list[ExperimentLog] = []
    if cfg.train.tensorboard:
        from .tensorboard import TensorBoardLog

        logs.append(TensorBoardLog(run_dir / "tensorboard", resumed_step=resumed_step))
    if cfg.train.wandb is not None and cfg.train.wandb.mode != "disabled":
        from .wandb_log import WandbLog

        logs.append(WandbLog(cfg, run_dir, attempt=attempt, resumed_step=resumed_step))
    return ExperimentLogs(logs) if logs else None
