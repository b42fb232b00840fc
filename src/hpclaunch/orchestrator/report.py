"""``hpclaunch report``: a run's story as PNG figures and one self-contained HTML page.

The page embeds every figure (base64), so it can be mailed or attached as one file; the PNGs are
written beside it for slides and notebooks. Everything is rendered in memory first and written
only at the end (each file atomically), so a failure leaves no half-written report. Works on a
running run (the current attempt ends "now"), a finished one, and a sweep (its points compared
in one figure, each point's own report in a sub-directory). Never imports torch.
"""

from __future__ import annotations

import base64
import html
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import RunNotFoundError, UserInputError
from ..rundir import RunPaths
from ..rundir.metrics import MetricsLine, read_metrics
from ..rundir.readers import sweep_roots
from ..schedulers.protocol import ACTIVE_STATES
from ..templates.shell import quote
from .accounting import PHASES, AttemptTime, RunTime, fmt_seconds
from .memory_tier_view import describe_memory_tier
from .status import StatusView, steps_text, summarize
from .stragglers import work_per_step

FIGURE_TITLES = {
    "timeline.png": "Where the time went",
    "loss.png": "Loss",
    "throughput.png": "Throughput",
    "ranks.png": "Step time per rank",
    "sweep.png": "The sweep's points",
}


@dataclass
class Report:
    directory: Path
    page: Path
    figures: list[Path] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what could not be drawn, and why
    points: list[Report] = field(default_factory=list)


def build_report(run: Path, out: Path | None = None, *, scheduler_status: Any = None) -> Report:
    """Render the report of ``run`` (a run or a sweep's root) into ``out`` (default RUN/report)."""
    paths = RunPaths(Path(run))
    if not paths.is_run():
        raise RunNotFoundError(
            f"{run} is not an hpclaunch run directory", where="RUN", hint="see runs/ for your runs"
        )
    out = Path(out) if out is not None else paths.root / "report"
    points = sweep_roots(paths)
    files = _sweep_files(paths.root, points) if points else _run_files(paths.root, scheduler_status)
    return _write(out, files)


# ---- one run -------------------------------------------------------------------------------------


@dataclass
class _Files:
    """A report rendered in memory: file name -> bytes, and the same for sub-reports."""

    items: dict[str, bytes]
    notes: list[str]
    subdirs: dict[str, _Files] = field(default_factory=dict)


def _run_summary(root: Path, scheduler_status: Any) -> tuple[StatusView, list[MetricsLine]]:
    return summarize(root, scheduler_status=scheduler_status), read_metrics(RunPaths(root).metrics)


def _run_files(root: Path, scheduler_status: Any) -> _Files:
    return _files_of(root, *_run_summary(root, scheduler_status))


def _files_of(root: Path, summary: StatusView, lines: list[MetricsLine]) -> _Files:
    from . import figures

    if not any(line.step is not None for line in lines):
        raise UserInputError(
            f"{root} has no metrics yet: the run has not logged a step",
            where="report",
            hint=f"wait for its first log step (train.log_every), or see: hpclaunch status {quote(root)}",
        )
    drawn = {
        "timeline.png": figures.timeline_figure(summary),
        "loss.png": figures.loss_figure(summary, lines),
        "throughput.png": figures.throughput_figure(summary, lines),
        "ranks.png": figures.ranks_figure(work_per_step(RunPaths(root))),
    }
    notes = []
    if drawn["ranks.png"] is None:
        if summary.state in ACTIVE_STATES:
            notes.append("no rank has recorded its step times yet (steptimes/)")
        else:  # an ended run will not get them: say why it has none
            notes.append(
                "no per-rank step times: a rank writes one summary every watchdog.straggler_every "
                "steps of an attempt (steptimes/), and no attempt of this run ran that long"
            )
    if drawn["loss.png"] is None:
        notes.append("no finite loss was logged yet")
    items = {name: png for name, png in drawn.items() if png is not None}
    items["index.html"] = _run_page(summary, items, notes).encode()
    return _Files(items, notes)


def _run_page(summary: StatusView, pngs: dict[str, bytes], notes: list[str]) -> str:
    spent = summary.time
    ratio = spent.goodput
    steps = f"step {summary.step}/{summary.steps or '?'}"
    loss = summary.loss
    head = [
        f"<p><b>{_e(summary.state)}</b> &middot; {_e(steps)}"
        + (f" &middot; loss {loss:.4f}" if isinstance(loss, (int, float)) else "")
        + f" &middot; {len(spent.attempts)} attempts, {summary.requeues} requeues</p>",
    ]
    if ratio is not None:
        head.append(
            f"<p class='big'>goodput <b>{ratio:.1%}</b>: {fmt_seconds(spent.training_s)} of kept training in "
            f"{fmt_seconds(spent.allocated_s)} allocated; {fmt_seconds(spent.queue_s)} waiting in the queue, "
            "not counted as allocated</p>"
        )
    head += [f"<p>{_e(line)}</p>" for line in describe_memory_tier(summary.memory_tier)]
    gp = summary.step_counts
    head.append(
        f"<p>steps: {gp.useful_steps} kept of {gp.computed_steps} computed; "
        f"{gp.repeated_steps} computed again after a crash, {gp.lost_steps} skipped</p>"
    )
    body = [_time_table(spent), *_figure_blocks(pngs), _attempts_table(summary)]
    body += [f"<p class='note'>{_e(n)}</p>" for n in notes]
    return _page(f"hpclaunch report: {summary.run_name}", summary.run, head + body)


def _time_table(spent: RunTime) -> str:
    from .figures import PHASE_STYLE

    cols = "".join(
        f"<th><span class='sw' style='background:{PHASE_STYLE[p][0]}'></span>{_e(PHASE_STYLE[p][1])}</th>"
        for p in PHASES
    )
    rows = []
    for i, a in enumerate(spent.attempts, 1):
        rows.append(_time_row(f"#{i} {a.attempt}", a))
    if len(spent.attempts) > 1:
        rows.append(_time_row("run", spent, bold=True))
    return (
        "<h2>Time by phase (seconds)</h2><table><tr><th>attempt</th>"
        + cols
        + "<th>allocated</th><th>goodput</th><th>lost steps</th></tr>"
        + "".join(rows)
        + "</table>"
    )


def _time_row(label: str, t: AttemptTime | RunTime, *, bold: bool = False) -> str:
    cells = "".join(f"<td>{seconds:.1f}</td>" for seconds in t.phase_seconds().values())
    ratio = t.goodput
    tag = " class='total'" if bold else ""
    return (
        f"<tr{tag}><td>{_e(label)}</td>{cells}<td>{float(t.allocated_s or 0):.1f}</td>"
        f"<td>{f'{ratio:.1%}' if ratio is not None else '-'}</td><td>{t.lost_steps or 0}</td></tr>"
    )


def _figure_blocks(pngs: dict[str, bytes]) -> list[str]:
    out = []
    for name, title in FIGURE_TITLES.items():
        if name in pngs:
            data = base64.b64encode(pngs[name]).decode()
            out.append(f"<h2>{_e(title)}</h2><img alt='{_e(title)}' src='data:image/png;base64,{data}'>")
    return out


def _attempts_table(summary: StatusView) -> str:
    rows = []
    for i, a in enumerate(summary.attempts, 1):
        steps = steps_text(a, " → ")
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(a.started)) if a.started else "-"
        rows.append(
            f"<tr><td>#{i}</td><td>{_e(a.attempt)}</td><td>{_e(started)}</td><td>{_e(steps)}</td>"
            f"<td>{_e(str(a.checkpoint_step or '-'))}</td><td>{_e(a.end)}</td>"
            f"<td>{_e(a.cause or '')}</td><td>{_e(a.error or '')}</td></tr>"
        )
    return (
        "<h2>Attempts</h2><table><tr><th>#</th><th>attempt</th><th>started</th><th>steps</th>"
        "<th>checkpoint</th><th>end</th><th>cause</th><th>error</th></tr>" + "".join(rows) + "</table>"
    )


# ---- a sweep -------------------------------------------------------------------------------------


def _sweep_files(root: Path, points: list[Path]) -> _Files:
    from . import figures

    gathered = []
    curves: list[figures.SweepCurve] = []
    subdirs: dict[str, _Files] = {}
    notes = []
    for point in points:
        if not RunPaths(point).is_run():
            notes.append(f"point {point.name}: not started (no run directory yet)")
            continue
        summary, lines = _run_summary(point, None)
        gathered.append((point.name, summary, lines))
        curves.append(figures.SweepCurve(point.name, summary.state, summary.time.goodput, lines))
        try:
            subdirs[point.name] = _files_of(point, summary, lines)
        except UserInputError as e:
            notes.append(f"point {point.name}: {e.one_line()}")
    sweep_png = figures.sweep_figure(curves)
    if sweep_png is None:
        raise UserInputError(
            f"{root} is a sweep whose points have no metrics yet",
            where="report",
            hint=f"wait for their first log steps, or see: hpclaunch status {quote(root)}",
        )
    items = {"sweep.png": sweep_png}
    links = "".join(
        f"<tr><td><a href='{_e(name)}/index.html'>{_e(name)}</a></td><td>{_e(s.state)}</td>"
        f"<td>{s.step}/{s.steps or '?'}</td>"
        f"<td>{_pct(s.time.goodput)}</td></tr>"
        for name, s, _ in gathered
        if name in subdirs
    )
    body = [
        *_figure_blocks(items),
        "<h2>Points</h2><table><tr><th>point</th><th>state</th><th>step</th><th>goodput</th></tr>"
        + links
        + "</table>",
        *(f"<p class='note'>{_e(n)}</p>" for n in notes),
    ]
    items["index.html"] = _page(f"hpclaunch report: sweep {root.name}", str(root), body).encode()
    return _Files(items, notes, subdirs)


# ---- the page and the files ----------------------------------------------------------------------

_STYLE = """
body{font-family:system-ui,sans-serif;max-width:1180px;margin:2em auto;padding:0 1em;color:#222}
h1{font-size:1.5em;margin-bottom:0.2em} h2{font-size:1.15em;margin-top:1.6em}
table{border-collapse:collapse;font-size:0.9em} td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}
td:first-child,th:first-child{text-align:left} tr.total{font-weight:bold} img{max-width:100%}
.sw{display:inline-block;width:0.8em;height:0.8em;margin-right:4px;border:1px solid #999}
.big{font-size:1.1em} .note{color:#8a6d00} .muted{color:#777;font-size:0.85em}
"""


def _page(title: str, where: str, body: list[str]) -> str:
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{_e(title)}</title>"
        f"<style>{_STYLE}</style></head><body><h1>{_e(title)}</h1>"
        f"<p class='muted'>{_e(where)} &middot; generated {stamp} by hpclaunch report</p>"
        + "\n".join(body)
        + "</body></html>\n"
    )


def _write(out: Path, files: _Files) -> Report:
    report = Report(directory=out, page=out / "index.html", notes=list(files.notes))
    out.mkdir(parents=True, exist_ok=True)
    for name, data in files.items.items():
        _atomic_write_bytes(out / name, data)
        if name.endswith(".png"):
            report.figures.append(out / name)
    for name, sub in files.subdirs.items():
        report.points.append(_write(out / name, sub))
    return report


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _e(text: str) -> str:
    return html.escape(str(text), quote=True)


def _pct(value: float | None) -> str:
    return f"{value:.1%}" if value is not None else "-"
