"""The experiment log: TensorBoard event files in ``RUN/tensorboard/``, written by rank 0.

Every attempt writes into the same directory (TensorBoard shows one run, not one per attempt).
An attempt that resumes from the checkpoint of step k opens its writer with ``purge_step=k + 1``:
TensorBoard then hides what an earlier attempt logged for steps after k (work lost when that
attempt died between checkpoints), so every step appears once, as in ``metrics.jsonl``.

Scalars (tag: metrics.jsonl field): ``loss/total`` loss, ``loss/text`` text_loss, ``loss/latent``
latent_loss, ``val/loss``, ``val/text_loss``, ``val/latent_loss``, ``train/lr`` lr,
``train/grad_norm`` grad_norm, ``train/skipped_steps`` skipped, ``perf/samples_per_s``,
``perf/tokens_per_s``, ``perf/tflops_per_gpu`` and ``perf/mfu`` (GPU runs), ``perf/step_time_s``, ``perf/max_memory_gb``. Starts and stops are marked
twice: a text entry under ``run/events`` ("resumed from step 40 ...", "stopped after step 57:
timeout") and a scalar ``run/resumed`` / ``run/stopped`` of 1 at that step.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # a type only: trainer.metrics_window imports torch
    from .metrics_window import Window

TAGS = {
    "loss": "loss/total",
    "text_loss": "loss/text",
    "latent_loss": "loss/latent",
    "val_loss": "val/loss",
    "val_text_loss": "val/text_loss",
    "val_latent_loss": "val/latent_loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "skipped": "train/skipped_steps",
    "samples_per_s": "perf/samples_per_s",
    "tokens_per_s": "perf/tokens_per_s",
    "tflops_per_gpu": "perf/tflops_per_gpu",
    "mfu": "perf/mfu",
    "step_time_s": "perf/step_time_s",
    "max_memory_gb": "perf/max_memory_gb",
}
EVENTS_TAG = "run/events"


class TensorBoardLog:
    """Rank 0's event-file writer for one attempt."""

    def __init__(self, directory: Path, *, resumed_step: int):
        from torch.utils.tensorboard import SummaryWriter

        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._writer = SummaryWriter(str(self.directory), purge_step=resumed_step + 1, flush_secs=10)

    def scalars(self, record: Window) -> None:
        """The numbers of one metrics.jsonl line (None and non-numbers are left out)."""
        step = int(step_of(record))
        for field, tag in TAGS.items():
            value = record.get(field)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self._writer.add_scalar(tag, float(value), step)

    def mark(self, what: str, step: int, text: str) -> None:
        """A start or stop (``what``: resumed, stopped, finished, failed) at ``step``."""
        self._writer.add_text(EVENTS_TAG, text, step)
        self._writer.add_scalar(f"run/{what}", 1.0, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def step_of(record: Window) -> float:
    """A metrics line's step: the loop sets it on every line."""
    step = record["step"]
    assert step is not None
    return step
