"""The loss figure's labels (why each attempt began) never sit on the curves (issue 39, 11)."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hpclaunch.orchestrator import figures
from hpclaunch.orchestrator.status import summarize
from hpclaunch.rundir import RunPaths
from hpclaunch.rundir.metrics import read_metrics

pytestmark = pytest.mark.fast

RECORDED = Path(__file__).resolve().parent / "recorded" / "requeued_run"  # 3 attempts, 2 requeues


def _dense(points: Any, n: int = 40) -> Any:
    """Points along every segment of a drawn line (its vertices alone would miss a crossing)."""
    pts = np.asarray(points, dtype=float)
    if len(pts) < 2:
        return pts
    t = np.linspace(0.0, 1.0, n)[:, None]
    return np.concatenate([a + t * (b - a) for a, b in itertools.pairwise(pts)])


def test_the_attempt_labels_keep_off_the_loss_curves(monkeypatch: pytest.MonkeyPatch) -> None:
    drawn: list[Any] = []
    monkeypatch.setattr(figures, "_png", lambda fig: drawn.append(fig) or b"png")
    summary = summarize(RECORDED)
    assert figures.loss_figure(summary, read_metrics(RunPaths(RECORDED).metrics)) == b"png"
    fig = drawn[0]
    ax = fig.axes[0]
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    labels = [t for t in ax.texts if t.get_text().startswith("#")]
    assert [t.get_text() for t in labels] == ["#2 after time limit", "#3 after time limit"]
    curves = [line for line in ax.get_lines() if line.get_linestyle() != "--"]
    assert curves
    for text in labels:
        box = text.get_window_extent(renderer)
        for line in curves:
            xy = line.get_transform().transform(_dense(line.get_xydata()))
            inside = [(x, y) for x, y in xy if box.x0 <= x <= box.x1 and box.y0 <= y <= box.y1]
            assert not inside, f"{text.get_text()!r} sits on {line.get_label()!r}"
    figures.plt.close(fig)
