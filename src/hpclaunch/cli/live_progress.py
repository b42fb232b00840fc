"""The live progress line of ``hpclaunch train`` in a terminal.

The ranks' output reaches the terminal through the rank host and the node agent's pipe, so the trainer
never sees a terminal and prints plain lines. This process does: it follows ``RUN/metrics.jsonl``
(rank 0 appends a line per log window) and keeps one line at the bottom of the terminal, redrawn
in place (step / total, a bar, the losses, validation, throughput, ETA), while everything the
ranks print scrolls above it. Off when stdout is not a terminal or ``HPCLAUNCH_PROGRESS=0``.
Torch-free.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..rundir.metrics import MetricsLine

PROGRESS_VAR = "HPCLAUNCH_PROGRESS"


class MetricsFollower:
    """The newest complete line of a growing metrics.jsonl (partial lines wait for their newline)."""

    def __init__(self, path: Path):
        self.path = path
        self.offset = 0
        self.partial = b""
        self.last: MetricsLine | None = None

    def poll(self) -> MetricsLine | None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except OSError:
            return self.last
        self.offset += len(chunk)
        *lines, self.partial = (self.partial + chunk).split(b"\n")
        for raw in lines:
            with contextlib.suppress(ValueError):
                record = json.loads(raw)
                if isinstance(record, dict) and "step" in record:
                    self.last = MetricsLine.from_json(record)
        return self.last


def describe(record: MetricsLine | None, total: int | None, width: int = 24) -> str:
    """``train ━━━━━━━╸        120/200  loss 2.3104 (text 1.21, latent 1.10)  val 2.40  85 samples/s  ETA 0:01:20``.
    ``total`` None: a script's run, whose lines say it (``total``)."""
    if total is None and record is not None and isinstance(record.value("total"), int):
        total = int(record.value("total"))
    if record is None or total is None:
        return f"train {' ' * width} {record.step or 0 if record else 0}/{total or '?'}  starting"
    step = record.step or 0  # the trainer writes a step on every line
    filled = int(width * min(step, total) / max(total, 1))
    bar = "━" * filled + " " * (width - filled)
    parts = [f"train {bar} {step}/{total}"]

    def num(v: object, fmt: str) -> str | None:  # the figures are as written: null, or not a number
        return format(v, fmt) if isinstance(v, (int, float)) else None

    if (loss := num(record.loss, ".4f")) is not None and record.text_loss is None:
        parts.append(f"loss {loss}")  # (a script's)
    elif loss is not None:
        parts.append(
            f"loss {loss} (text {num(record.text_loss, '.3f')}, latent {num(record.latent_loss, '.3f')})"
        )
    if (val := num(record.value("val_loss"), ".4f")) is not None:
        parts.append(f"val {val}")
    if (sps := num(record.samples_per_s, ".1f")) is not None:
        parts.append(f"{sps} samples/s")
    if (mfu := num(record.value("mfu"), ".1%")) is not None:
        parts.append(f"MFU {mfu}")
    st = record.step_time_s
    if isinstance(st, (int, float)) and step < total:
        left = int(st * (total - step))
        parts.append(f"ETA {left // 3600}:{left // 60 % 60:02d}:{left % 60:02d}")
    return "  ".join(parts)


class _LiveStdout:
    """``sys.stdout`` while the line is shown: text and bytes (the agent writes bytes to
    ``sys.stdout.buffer``) are printed above the live line instead of through it."""

    def __init__(self, console: Any, real: Any):
        self._console = console
        self._real = real
        self.buffer = self
        self._pending = ""

    def write(self, data: str | bytes) -> int:
        text = data.decode(errors="replace") if isinstance(data, bytes) else data
        *lines, self._pending = (self._pending + text).split("\n")
        for line in lines:
            self._console.print(line, markup=False, highlight=False, soft_wrap=True)
        return len(data)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return True

    def fileno(self) -> int:
        return int(self._real.fileno())


def enabled() -> bool:
    return os.environ.get(PROGRESS_VAR, "1") not in ("0", "false", "no") and sys.stdout.isatty()


@contextlib.contextmanager
def live_progress(metrics: Path, total_steps: int | None, *, every_s: float = 0.5) -> Iterator[None]:
    """Show the progress line at the bottom of the terminal while the block runs (when ``enabled``)."""
    if not enabled():
        yield
        return
    from rich.console import Console
    from rich.live import Live
    from rich.text import Text

    real = sys.stdout
    console = Console(file=real, soft_wrap=True)
    follower = MetricsFollower(metrics)
    done = threading.Event()
    with Live(
        Text(describe(None, total_steps)), console=console, auto_refresh=False, transient=False
    ) as live:

        def follow() -> None:
            shown = ""
            while not done.wait(every_s):
                text = describe(follower.poll(), total_steps)
                if text != shown:  # redraw only what changed
                    live.update(Text(text), refresh=True)
                    shown = text

        thread = threading.Thread(target=follow, name="hpclaunch-progress-line", daemon=True)
        sys.stdout = _LiveStdout(live.console, real)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join(timeout=2)
            sys.stdout = real
            live.update(Text(describe(follower.poll(), total_steps)), refresh=True)
