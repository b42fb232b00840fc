"""Training metrics: on-device accumulation, ``RUN/metrics.jsonl``, and what rank 0 shows.

Per-step values stay on the device and are summed there (``MetricsWindow.add``); the host reads
them only at log steps (``MetricsWindow.collect``), so ``log_every`` > 1 forces no host sync per
step. Each ``metrics.jsonl`` line describes the window of steps since the previous line:

- ``loss``, ``text_loss``, ``latent_loss``, ``grad_norm``: means over the window's non-skipped
  steps, averaged over ranks (null when every step of the window was skipped);
- ``step_time_s``: mean wall time of a step on rank 0 (``step_sleep_s`` included);
- ``samples_per_s`` = global batch / step time; ``tokens_per_s`` counts text tokens plus latent
  vectors per sample;
- ``tflops_per_gpu``, ``mfu`` (GPU runs on a GPU whose peak is known: ``modelmath``): model FLOPs
  of a step (``modelmath.train_flops_per_sample`` x the global batch) per step time and GPU, and
  that over the GPU's dense bf16 peak; null on CPU ranks;
- ``lr``: the learning rate of the last step; ``skipped``: non-finite steps so far (cumulative);
- ``ts``: epoch seconds when the line was written (right after the window's last step);
  ``attempt``: the attempt that computed the window (``status`` and ``report`` time the run by them).
- ``val_loss``, ``val_text_loss``, ``val_latent_loss``: validation losses of the fixed validation
  set at this step (``train.eval_every``; null on other lines);
- ``max_memory_gb``: this rank's (rank 0's) peak memory so far: CUDA memory allocated by tensors
  on a GPU, the process's peak resident set on CPU.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ...fsutil import append_line

# One logging window's numbers by name (None: not measured in it): the loop adds its own (step, lr,
# throughput, validation losses) to ``collect()``'s, so the keys are open; every value is a number.
Window = dict[str, float | None]
# A metrics.jsonl line: a window's FIELDS, stamped with the time and the attempt.
Line = dict[str, float | str | None]

FIELDS = (
    "step",
    "loss",
    "text_loss",
    "latent_loss",
    "grad_norm",
    "lr",
    "samples_per_s",
    "tokens_per_s",
    "tflops_per_gpu",
    "mfu",
    "step_time_s",
    "skipped",
    "ts",  # stamped by MetricsLog.write
    "attempt",
    "val_loss",
    "val_text_loss",
    "val_latent_loss",
    "max_memory_gb",
)


class MetricsWindow:
    """Sums of (loss, text, latent, grad_norm, good steps) kept on ``device`` between log steps."""

    def __init__(self, device: torch.device):
        self.device = device
        self._sums = torch.zeros(5, dtype=torch.float64, device=device)
        self._one = torch.ones((), dtype=torch.float64, device=device)
        self.steps = 0
        self.time_s = 0.0

    def add(
        self, loss: Tensor, text: Tensor, latent: Tensor, grad_norm: Tensor, *, ok: bool, step_time_s: float
    ) -> None:
        self.steps += 1
        self.time_s += step_time_s
        if ok:
            vals = torch.stack([loss.double(), text.double(), latent.double(), grad_norm.double(), self._one])
            self._sums += vals

    def collect(self, all_reduce: Callable[[Tensor], None] | None = None, world_size: int = 1) -> Window:
        """Window means (reduced over ranks with ``all_reduce``, a SUM in place), then reset."""
        sums = self._sums
        if all_reduce is not None and world_size > 1:
            sums = sums.clone()
            all_reduce(sums)
            sums[:4] /= world_size
            sums[4] /= world_size
        loss, text, latent, gnorm, good = sums.tolist()
        out: Window = {
            "loss": _mean(loss, good),
            "text_loss": _mean(text, good),
            "latent_loss": _mean(latent, good),
            "grad_norm": _mean(gnorm, good),
            "step_time_s": self.time_s / self.steps if self.steps else None,
        }
        self._sums.zero_()
        self.steps = 0
        self.time_s = 0.0
        return out


def max_memory_gb(device: torch.device) -> float:
    """Peak memory of this rank so far, in GB (CUDA: allocated by tensors; CPU: peak RSS)."""
    if device.type == "cuda":
        return round(torch.cuda.max_memory_allocated(device) / 1e9, 4)
    import resource

    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9, 4)  # KiB on Linux


def _mean(total: float, count: float) -> float | None:
    if count <= 0:
        return None
    value = total / count
    return value if math.isfinite(value) else None


def json_safe(value: float | None) -> float | None:
    """JSON has no NaN/Infinity: non-finite floats become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsLog:
    """Rank 0's writer: ``metrics.jsonl`` plus a progress bar (terminal) or plain lines."""

    def __init__(
        self,
        path: Path,
        *,
        total_steps: int,
        start_step: int,
        tty: bool | None = None,
        echo: bool = True,
        attempt: str | None = None,
    ):
        self.path = Path(path)
        self.attempt = attempt
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.total = total_steps
        self.echo = echo
        self.tty = echo and (sys.stdout.isatty() if tty is None else tty)
        self._progress: Any = None
        self._task: Any = None
        if self.tty:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._progress = Progress(
                TextColumn("train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"),
                TimeRemainingColumn(),
            )
            self._task = self._progress.add_task("train", total=total_steps, completed=start_step, info="")
            self._progress.start()

    def write(self, record: Window) -> None:
        line: Line = {k: json_safe(record.get(k)) for k in FIELDS}
        line.update(ts=round(time.time(), 3), attempt=self.attempt)
        append_line(self.path, json.dumps(line))
        if not self.echo:
            return
        info = describe(line)
        if self._progress is not None:
            self._progress.update(self._task, completed=line["step"], info=info)
        else:
            print(f"step {line['step']}/{self.total} {info}", flush=True)

    def message(self, text: str) -> None:
        if self._progress is not None:
            self._progress.console.print(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


def describe(line: Line) -> str:
    def f(key: str, fmt: str) -> str:
        v = line.get(key)
        return "-" if v is None else format(v, fmt)

    text = (
        f"loss {f('loss', '.4f')} (text {f('text_loss', '.4f')}, latent {f('latent_loss', '.4f')}) "
        f"gnorm {f('grad_norm', '.3f')} lr {f('lr', '.2e')} {f('samples_per_s', '.1f')} samples/s"
    )
    if line.get("mfu") is not None:
        text += f" {f('tflops_per_gpu', '.0f')} TFLOP/s/GPU (MFU {f('mfu', '.1%')})"
    if line.get("skipped"):
        text += f" skipped {line['skipped']}"
    if line.get("val_loss") is not None:
        text += f" val {f('val_loss', '.4f')}"
    return text
