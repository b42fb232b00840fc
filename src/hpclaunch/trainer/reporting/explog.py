"""The experiment logs rank 0 writes besides ``metrics.jsonl``: TensorBoard (``train.tensorboard``)
and Weights & Biases (``train.wandb``), behind one object with TensorBoardLog's three calls, so the
loop logs a window or marks a start or stop once, whatever is on.

Logging never ends training. W&B online that cannot reach its server (a compute node without
internet, an outage) goes on offline into ``RUN/wandb/`` (``wandb sync`` uploads it later); a log
that fails to open or to write is dropped for the rest of the attempt. Each such fall-back is said
once, through ``on_failure`` (the loop writes it to the ledger, where ``status`` finds it, and to
the console); ``metrics.jsonl`` always has every number.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from ...config import RunConfig
from ...errors import error_text

if TYPE_CHECKING:  # a type only: trainer.metrics_window imports torch
    from .metrics_window import Window

# (which log, what went wrong, what was done instead)
OnFailure = Callable[[str, str, str], None]
DROPPED = "dropped for the rest of this attempt (metrics.jsonl has every number)"


class ExperimentLog(Protocol):
    def scalars(self, record: Window) -> None: ...

    def mark(self, what: str, step: int, text: str) -> None: ...

    def close(self) -> None: ...


class ExperimentLogs:
    """Every configured experiment log; each call goes to all of them. A log whose call raises is
    dropped (said once through ``on_failure``); training goes on."""

    def __init__(self, logs: dict[str, ExperimentLog], on_failure: OnFailure):
        self.logs = dict(logs)
        self.on_failure = on_failure

    def _each(self, call: Callable[[ExperimentLog], None]) -> None:
        for name, log in list(self.logs.items()):
            try:
                call(log)
            except Exception as e:  # a logging library's failure of any kind is not training's
                del self.logs[name]
                self.on_failure(name, error_text(e), DROPPED)

    def scalars(self, record: Window) -> None:
        self._each(lambda log: log.scalars(record))

    def mark(self, what: str, step: int, text: str) -> None:
        self._each(lambda log: log.mark(what, step, text))

    def close(self) -> None:
        self._each(lambda log: log.close())


def open_experiment_logs(
    cfg: RunConfig, run_dir: Path, *, attempt: str, resumed_step: int, on_failure: OnFailure
) -> ExperimentLogs | None:
    """The logs this run's config asks for (None: neither TensorBoard nor W&B, or none opened)."""
    logs: dict[str, ExperimentLog] = {}
    if cfg.train.tensorboard:
        try:
            from .tensorboard import TensorBoardLog

            logs["tensorboard"] = TensorBoardLog(run_dir / "tensorboard", resumed_step=resumed_step)
        except Exception as e:
            on_failure("tensorboard", error_text(e), DROPPED)
    if cfg.train.wandb is not None and cfg.train.wandb.mode != "disabled":
        from .wandb_log import WandbLog

        try:
            wandb = WandbLog(cfg, run_dir, attempt=attempt, resumed_step=resumed_step)
        except Exception as e:
            on_failure("wandb", error_text(e), DROPPED)
        else:
            logs["wandb"] = wandb
            if wandb.offline_because is not None:
                on_failure("wandb", wandb.offline_because, wandb.OFFLINE_ACTION)
    return ExperimentLogs(logs, on_failure) if logs else None
