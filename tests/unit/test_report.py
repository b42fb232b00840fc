"""``hpclaunch report`` on synthetic run directories: every figure, the page, a sweep, bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tests.unit.test_accounting import EVENTS, LIMIT, METRICS

from hpclaunch.orchestrator.report import build_report

ROOT = Path(__file__).resolve().parents[2]


def make_run(root: Path, *, metrics: bool = True, extra: bool = True) -> Path:
    root.mkdir(parents=True)
    (root / "plan.json").write_text(json.dumps({"time_limit_s": LIMIT, "scheduler": "local"}))
    (root / "config.yaml").write_text("train:\n  steps: 70\n")
    (root / "events").mkdir()
    (root / "events" / "all-host-1.jsonl").write_text("".join(json.dumps(e) + "\n" for e in EVENTS))
    if metrics:
        lines = []
        for m in METRICS:
            line = {**m, "text_loss": 0.6, "latent_loss": 0.4, "samples_per_s": 16.0}
            if extra and m["step"] % 20 == 0:
                line["val_loss"] = 0.9
            lines.append(line)
        (root / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    if extra:  # each rank's own work per step, as rank.progress writes it; rank 1 slows down
        (root / "steptimes").mkdir()
        for rank in (0, 1):
            summaries = [
                {
                    "rank": rank,
                    "node": "n1",
                    "step": m["step"],
                    "work_s": 1.3 if rank and m["step"] > 40 else 1.0,
                }
                for m in METRICS
            ]
            text = "".join(json.dumps(x) + "\n" for x in summaries) + '{"rank": 1, "st'  # a torn last line
            (root / "steptimes" / f"rank{rank}.jsonl").write_text(text)
    return root


def test_a_run_gets_every_figure_and_one_page_that_embeds_them(tmp_path: Path) -> None:
    run = make_run(tmp_path / "runs" / "a<b>&c")
    report = build_report(run)
    assert report.directory == run / "report"
    assert sorted(p.name for p in report.figures) == [
        "loss.png",
        "ranks.png",
        "throughput.png",
        "timeline.png",
    ]
    for png in report.figures:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    page = report.page.read_text()
    assert page.count("data:image/png;base64,") == 4
    assert "a&lt;b&gt;&amp;c" in page and "a<b>" not in page  # the run's name is escaped
    assert "crash" in page and "lost steps" in page and report.notes == []
    assert not list(report.directory.glob(".*tmp*"))  # written atomically, nothing left over


def test_a_run_without_per_rank_times_says_so(tmp_path: Path) -> None:
    """An ended run says why it has none (issue 26: "... yet" on a finished run)."""
    report = build_report(make_run(tmp_path / "r", extra=False), tmp_path / "out")
    assert "ranks.png" not in {p.name for p in report.figures}
    (note,) = report.notes
    assert note.startswith("no per-rank step times: a rank writes one summary every ") and "yet" not in note
    assert "watchdog.straggler_every" in report.page.read_text()


def test_a_sweep_compares_its_points_and_reports_each(tmp_path: Path) -> None:
    root = tmp_path / "sweep"
    a = make_run(root / "lr-1")
    b = make_run(root / "lr-2", metrics=False)
    (root / "plan.json").write_text("{}")
    (root / "sweep.json").write_text(json.dumps({"points": [{"run_dir": str(a)}, {"run_dir": str(b)}]}))
    report = build_report(root)
    assert [p.name for p in report.figures] == ["sweep.png"]
    assert [p.directory.name for p in report.points] == ["lr-1"]
    assert (root / "report" / "lr-1" / "loss.png").exists()
    assert any("lr-2" in n and "no metrics yet" in n for n in report.notes)
    assert "lr-1/index.html" in report.page.read_text()


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hpclaunch", *args], cwd=cwd, capture_output=True, text=True)


@pytest.mark.parametrize("case", ["not a run", "no metrics"])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path: Path, case: str) -> None:
    run = tmp_path / "x"
    if case == "no metrics":
        make_run(run, metrics=False)
    else:
        run.mkdir()
    result = _cli("report", str(run), "-o", str(tmp_path / "out"), cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    first = result.stderr.splitlines()[0]
    assert first.startswith("hpclaunch: error:") and "Traceback" not in result.stderr
    assert ("is not an hpclaunch run directory" if case == "not a run" else "has no metrics yet") in first
    assert not (tmp_path / "out").exists()


def test_report_draws_without_torch(tmp_path: Path) -> None:
    run = make_run(tmp_path / "r")
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "hpclaunch", "report", str(run)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"report: {run / 'report' / 'index.html'}" in result.stdout
    modules = {line.rsplit("|", 1)[1].strip() for line in result.stderr.splitlines() if "|" in line}
    assert "matplotlib" in modules and not any(m == "torch" or m.startswith("torch.") for m in modules)


def test_the_sweep_figures_point_names_do_not_run_into_the_left_panel() -> None:
    """Issue 26: in sweep.png the right panel's labels ran into the left panel's legend."""
    import matplotlib.pyplot as plt

    from hpclaunch.orchestrator.figures import SweepCurve, sweep_axes
    from hpclaunch.rundir.metrics import MetricsLine

    names = [
        f"p{i}-lr{lr}-depth{d}-dim_text{w}" for i, (lr, d, w) in enumerate([("1e-3", 2, 64), ("3e-4", 4, 96)])
    ]
    lines = [MetricsLine(step=s, loss=1.0 / s) for s in range(1, 20)]
    points = [SweepCurve(n, "finished", 0.8, lines) for n in names]
    fig = sweep_axes(points)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()  # type: ignore[attr-defined]
    left, right = fig.axes
    left_edge = max(left.get_window_extent(renderer).x1, left.get_legend().get_window_extent(renderer).x1)
    labels = [t.get_window_extent(renderer).x0 for t in right.get_yticklabels() if t.get_text()]
    plt.close(fig)
    assert labels and min(labels) > left_edge


def test_the_report_says_the_memory_tier_is_on_and_which_tier_each_attempt_resumed_from(
    tmp_path: Path,
) -> None:
    run = make_run(tmp_path / "runs" / "mem", extra=False)
    (run / "config.yaml").write_text("train:\n  steps: 70\ncheckpoint:\n  memory:\n    every_steps: 5\n")
    last = [e for e in EVENTS if e["event"] == "resumed"][-1]  # attempt 7.2's, from the disk
    resumed = {**last, "tier": "disk", "disk_step": last["step"]}
    resumed["memory_reason"] = "no snapshot in memory on this attempt's nodes"
    with (run / "events" / "all-host-1.jsonl").open("a") as f:
        f.write(json.dumps(resumed) + "\n")
    page = build_report(run, tmp_path / "out").page.read_text()
    assert "memory tier: on, a snapshot every 5 steps" in page
    assert "attempt 7.2 resumed from the disk: no snapshot in memory on this attempt&#x27;s nodes" in page
    assert "(disk)" in page
