"""Rank 0's record of what a script logs (``run.log``): one ``RUN/metrics.jsonl`` line per call,
read by ``hpclaunch status``, ``report`` and ``train``'s live progress like the MMDiT trainer's
lines, TensorBoard scalars where TensorBoard is installed, and a console line at most every
``ECHO_EVERY_S`` (a script that logs every step does not flood its log).

A line: the script's values, ``step``, ``total`` (the steps the run trains to), ``step_time_s``
(the mean step time since the previous line, ``run.phase`` time left out), ``ts`` and ``attempt``.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from typing import Any

from ..fsutil import append_line
from ..rundir import RunPaths

__all__ = ["StepLog"]

ECHO_EVERY_S = 2.0


class StepLog:
    def __init__(
        self, paths: RunPaths, *, attempt: str, total: int | None, start_step: int, echo: bool
    ) -> None:
        self.path = paths.metrics
        self.tb_dir = paths.root / "tensorboard"
        self.attempt = attempt
        self.total = total
        self.echo = echo
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._times: list[float] = []
        self._last_echo = 0.0
        self._tb: Any = None
        self._tb_failed = False
        self._start_step = start_step

    def stepped(self, step: int, seconds: float) -> None:
        self._times.append(seconds)

    def log(self, step: int, values: dict[str, Any]) -> None:
        times, self._times = self._times, []
        step_time = sum(times) / len(times) if times else None
        line: dict[str, Any] = {k: _safe(v) for k, v in values.items()}
        line.update(
            step=step,
            total=self.total,
            step_time_s=round(step_time, 6) if step_time is not None else None,
            ts=round(time.time(), 3),
            attempt=self.attempt,
        )
        append_line(self.path, json.dumps(line))
        self._scalars(step, values)
        now = time.monotonic()
        if self.echo and (now - self._last_echo >= ECHO_EVERY_S or step == self.total):
            self._last_echo = now
            shown = " ".join(f"{k} {_fmt(v)}" for k, v in values.items())
            per = f" ({step_time:.3g} s/step)" if step_time else ""
            print(f"step {step}/{self.total if self.total is not None else '?'} {shown}{per}", flush=True)

    def message(self, text: str) -> None:
        if self.echo:
            print(f"hpclaunch: {text}", flush=True)

    def _scalars(self, step: int, values: dict[str, Any]) -> None:
        if self._tb_failed:
            return
        if self._tb is None:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(log_dir=str(self.tb_dir))
            except Exception:  # (TensorBoard not installed, or its directory cannot be made)
                self._tb_failed = True
                return
        for key, value in values.items():
            if isinstance(value, (int, float)) and math.isfinite(value):
                self._tb.add_scalar(f"train/{key}", value, step)

    def close(self) -> None:
        if self._tb is not None:
            with contextlib.suppress(Exception):
                self._tb.close()
            self._tb = None


def _safe(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else value


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "-" if value is None else str(value)
