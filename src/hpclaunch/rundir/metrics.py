"""``RUN/metrics.jsonl`` as read back: one ``MetricsLine`` per logging window (``trainer.reporting.metrics_window``
writes them). ``status``, the time accounting and ``report`` read the same lines."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..fsutil import read_jsonl


@dataclass(frozen=True)
class MetricsLine:
    """One logging window: the step that closes it, when, in which attempt, and its means.

    The figures are kept as written (a loss logged as ``null`` or ``NaN`` stays so); ``record`` is
    the whole line, for the keys a config adds (validation losses)."""

    step: int | None = None
    ts: float | None = None
    attempt: str | None = None
    loss: float | None = None
    text_loss: float | None = None
    latent_loss: float | None = None
    samples_per_s: float | None = None
    step_time_s: float | None = None
    record: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> MetricsLine:
        step, ts, attempt = data.get("step"), data.get("ts"), data.get("attempt")
        return cls(
            step=int(step) if step is not None else None,
            ts=float(ts) if ts is not None else None,
            attempt=str(attempt) if attempt is not None else None,
            loss=data.get("loss"),
            text_loss=data.get("text_loss"),
            latent_loss=data.get("latent_loss"),
            samples_per_s=data.get("samples_per_s"),
            step_time_s=data.get("step_time_s"),
            record=data,
        )

    def value(self, name: str) -> Any:
        """The line's ``name`` (None when it has none): for keys without a field of their own."""
        return self.record.get(name)

    def own_scalars(self, most: int = 3) -> dict[str, float]:
        """The numbers a script logged itself (``run.log(loss_d=..., loss_g=...)``), in the order
        logged, at most ``most``: the line less what hpclaunch writes beside them."""
        numbers = {
            k: float(v)
            for k, v in self.record.items()
            if k not in BOOKKEEPING and isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        return dict(list(numbers.items())[:most])


# What every metrics line holds beside what a run logs itself (``rank.step_log``, the trainer's window).
BOOKKEEPING = frozenset(
    {"step", "total", "ts", "attempt", "step_time_s", "samples_per_s", "tflops_per_gpu", "mfu"}
)


def read_metrics(path: Path) -> list[MetricsLine]:
    """Every complete line of ``metrics.jsonl`` (a torn last line is left out)."""
    return [MetricsLine.from_json(line) for line in read_jsonl(path)]
