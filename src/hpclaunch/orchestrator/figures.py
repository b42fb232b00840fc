"""The report's figures, drawn with matplotlib's Agg backend (no display needed) into PNG bytes.

Each function takes the status view (``status.StatusView``, its ``time`` accounting) and the metrics
lines (``rundir.metrics.MetricsLine``) and returns the PNG's bytes, or None when the run has nothing
to draw for that figure. Never imports torch.
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING, Any, NamedTuple

import matplotlib

matplotlib.use("Agg")  # before pyplot: no display on login nodes or in CI

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.transforms import blended_transform_factory

from ..rundir.cause import Cause, UnknownCause
from ..rundir.metrics import MetricsLine

if TYPE_CHECKING:
    from .accounting import RunTime
    from .status import Attempt, StatusView

# One colour per phase, the same in every figure and in the HTML table.
PHASE_STYLE: dict[str, tuple[str, str]] = {
    "queue": ("#e3e3e3", "queue (not allocated)"),
    "startup": ("#f0a202", "start-up"),
    "training": ("#2a9d46", "training (kept)"),
    "stall": ("#7b3fa0", "checkpoint stall"),
    "lost": ("#d62728", "lost work"),
    "end_save": ("#1f77b4", "stop + save"),
    "idle": ("#9a9a9a", "idle"),
}
VAL_COLOURS = ("#9467bd", "#2ca02c", "#8c564b")
LOSS_KEYS = (
    ("loss", "loss", "#222222"),
    ("text_loss", "text", "#1f77b4"),
    ("latent_loss", "latent", "#ff7f0e"),
)
DPI = 110
MAX_LABELLED_ATTEMPTS = 12  # more boundaries than this are drawn without their labels


def _png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, bbox_inches="tight", facecolor="white")
    plt.close(fig)
    return buf.getvalue()


def _clock(spent: RunTime, origin: float) -> tuple[float, str]:
    """Seconds or minutes on the time axis, whichever a person reads more easily for this run."""
    last = max((s.end for a in spent.attempts for s in a.segments), default=origin)
    return (60.0, "min") if last - origin > 300 else (1.0, "s")


def origin_of(spent: RunTime) -> float | None:
    starts = [s.start for a in spent.attempts for s in a.segments]
    return min(starts) if starts else None


def cause_words(cause: str | None) -> str:
    """A cause as a person says it (the ledger's words are short)."""
    try:
        known = Cause.parse_optional(cause)
    except UnknownCause:
        return str(cause)
    return known.words if known is not None else "stop"


def end_label(attempt: Attempt | None) -> str:
    """How an attempt ended, in a few words: 'time limit -> requeued', 'crash -> requeued', 'finished'."""
    end = (attempt.end if attempt else None) or "running"
    cause = attempt.cause if attempt else None
    if end in ("requeued", "restarted in place"):
        return f"{cause_words(cause)} → {end}"
    if end in ("stopped", "failed") and cause:
        return f"{end} ({cause_words(cause)})"
    return end


# ---- the loss against step, with every attempt's boundary and stop marked ---------------------


def loss_figure(summary: StatusView, lines: list[MetricsLine]) -> bytes | None:
    times = {a.attempt: a for a in summary.time.attempts}
    by_attempt: dict[str, list[MetricsLine]] = {}
    for line in lines:
        by_attempt.setdefault(str(line.attempt), []).append(line)
    if not any(line.loss is not None for line in lines):
        return None
    val_keys = sorted({k for line in lines for k in line.record if k.startswith("val") and "loss" in k})
    fig, ax = plt.subplots(figsize=(10, 5.2))
    labelled: set[str] = set()
    for key, rows in by_attempt.items():
        spent = times.get(key)
        kept = spent.kept_step if spent else None
        for name, label, colour in LOSS_KEYS:
            pts = [(r.step, r.value(name)) for r in rows if r.step is not None and r.value(name) is not None]
            good = [p for p in pts if kept is None or p[0] <= kept]
            lost = [p for p in pts if kept is not None and p[0] >= kept]
            if good:
                ax.plot(
                    *zip(*good, strict=True),
                    color=colour,
                    lw=1.6,
                    marker="o" if len(good) < 4 else None,  # a short attempt is still seen
                    ms=3,
                    label=None if label in labelled else label,
                )
                labelled.add(label)
            if len(lost) > 1:
                ax.plot(*zip(*lost, strict=True), color=colour, lw=1.2, ls=":", alpha=0.6)
        for j, name in enumerate(val_keys):
            pts = [(r.step, r.value(name)) for r in rows if r.step is not None and r.value(name) is not None]
            if pts:
                core = name.removeprefix("val").removesuffix("loss").strip("_").replace("_", " ")
                tag = f"validation {core}".strip()
                colour = VAL_COLOURS[j % len(VAL_COLOURS)]
                ax.plot(
                    *zip(*pts, strict=True),
                    "s--",
                    color=colour,
                    ms=4,
                    lw=1,
                    label=None if tag in labelled else tag,
                )
                labelled.add(tag)
    _mark_attempts(ax, summary)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (mean over each logging window)")
    ax.set_title(f"loss of {summary.run_name}: {_attempts_caption(summary)}", loc="left", fontsize=11)
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if any(a.lost_steps for a in summary.time.attempts):
        handles.append(Patch(color=PHASE_STYLE["lost"][0], alpha=0.15))
        labels.append("steps lost (dotted: computed, then discarded)")
    handles.append(plt.Line2D([], [], color="#555555", ls="--", lw=1))
    labels.append("attempt boundary (label: why the previous one ended)")
    # below the axes: the curves keep the whole plot
    ax.legend(
        handles, labels, loc="upper center", bbox_to_anchor=(0.5, -0.11), ncol=3, fontsize=8, frameon=False
    )
    return _png(fig)


def _attempts_caption(summary: StatusView) -> str:
    n = len(summary.time.attempts)
    lost = sum(a.lost_steps or 0 for a in summary.time.attempts)
    text = f"{n} attempt{'s' if n != 1 else ''}, {summary.requeues} requeue{'s' if summary.requeues != 1 else ''}"
    return text + (f", {lost} steps lost" if lost else "") + f"; {summary.state}"


# The labels live in a band above every curve: the y axis is raised by this share of its span, and
# neighbouring labels step down in turn (LABEL_ROWS rows) so that close boundaries do not collide.
LABEL_BAND = 0.3
LABEL_ROWS = 3


def _mark_attempts(ax: Any, summary: StatusView) -> None:
    """A dashed line where each attempt resumed, labelled with why the previous one ended."""
    times = summary.time.attempts
    trans = blended_transform_factory(ax.transData, ax.transAxes)
    labels = len(times) <= MAX_LABELLED_ATTEMPTS
    if labels and len(times) > 1:
        low, high = ax.get_ylim()
        ax.set_ylim(low, high + (high - low) * LABEL_BAND)
    top = 1.0 - 0.03  # axes fraction; the band starts at 1 / (1 + LABEL_BAND) ~ 0.77
    for i, t in enumerate(times):
        if t.lost_steps:
            ax.axvspan(t.kept_step, t.last_step, color=PHASE_STYLE["lost"][0], alpha=0.15, lw=0)
        if i == 0 or t.first_step is None:
            continue
        x = t.first_step
        ax.axvline(x, color="#555555", ls="--", lw=1)
        if labels:
            prev = summary.attempt(times[i - 1].attempt)
            prev_cause, prev_end = (prev.cause, prev.end) if prev else (None, None)
            text = f"#{i + 1} after {cause_words(prev_cause) if prev_cause else prev_end}"
            y = top - 0.065 * ((i - 1) % LABEL_ROWS)
            ax.annotate(
                text, (x, y), xycoords=trans, xytext=(3, 0), textcoords="offset points", ha="left", va="top",
                fontsize=8,
            )  # fmt: skip


# ---- where the wall-clock time went, attempt by attempt ------------------------------------------


def timeline_figure(summary: StatusView) -> bytes | None:
    spent = summary.time
    origin = origin_of(spent)
    if origin is None:
        return None
    scale, unit = _clock(spent, origin)
    n = len(spent.attempts)
    height = 1.6 + 0.55 * min(n, 30)
    fig, ax = plt.subplots(figsize=(10, height))
    seen: list[str] = []
    right = 0.0
    for row, t in enumerate(spent.attempts):
        for phase, start, end in ((s.phase, s.start, s.end) for s in t.segments):
            colour = PHASE_STYLE[phase][0]
            x0, width = (start - origin) / scale, (end - start) / scale
            ax.barh(
                row,
                width,
                left=x0,
                height=0.6,
                color=colour,
                edgecolor="#777777" if phase == "queue" else colour,
                lw=0.5,
            )
            if phase not in seen:
                seen.append(phase)
            right = max(right, x0 + width)
        text = end_label(summary.attempt(t.attempt))
        if t.lost_steps:
            text += f", {t.lost_steps} steps lost"
        if t.goodput is not None:
            text += f"  [{t.goodput:.0%}]"
        end_x = max((s.end for s in t.segments), default=origin)
        ax.text((end_x - origin) / scale, row, "  " + text, va="center", fontsize=8)
    ax.set_yticks(range(n), [f"#{i + 1}" for i in range(n)])
    ax.invert_yaxis()
    ax.set_xlim(0, right * 1.3 if right else 1)
    ax.set_xlabel(f"wall clock since the first submission ({unit})")
    ratio = spent.goodput
    title = f"where the time went: {summary.run_name}"
    if ratio is not None:
        title += f", goodput {ratio:.0%} of the allocated time  [per attempt in brackets]"
    ax.set_title(title, loc="left", fontsize=11)
    ax.grid(axis="x", alpha=0.3)
    order = [p for p in PHASE_STYLE if p in seen]
    handles = [
        Patch(facecolor=PHASE_STYLE[p][0], edgecolor="#777777" if p == "queue" else PHASE_STYLE[p][0])
        for p in order
    ]
    ax.legend(
        handles,
        [PHASE_STYLE[p][1] for p in order],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.5 / (height * 0.77)),  # 0.5 in below the axes: under the x label
        ncol=min(len(order), 4),
        fontsize=8,
        frameon=False,
    )
    return _png(fig)


# ---- throughput over wall-clock time -----------------------------------------------------------


def throughput_figure(summary: StatusView, lines: list[MetricsLine]) -> bytes | None:
    spent = summary.time
    origin = origin_of(spent)
    pts = [line for line in lines if line.samples_per_s and line.ts]
    if origin is None or not pts:
        return None
    scale, unit = _clock(spent, origin)
    fig, (ax, strip) = plt.subplots(
        2, 1, figsize=(10, 4.2), sharex=True, gridspec_kw={"height_ratios": [7, 1], "hspace": 0.08}
    )
    keys = [a.attempt for a in spent.attempts]
    for key in dict.fromkeys(str(p.attempt) for p in pts):
        rows = [p for p in pts if str(p.attempt) == key]
        number = keys.index(key) + 1 if key in keys else "?"
        xs = [(float(p.ts or 0.0) - origin) / scale for p in rows]
        ax.plot(xs, [p.samples_per_s for p in rows], "o-", ms=3, lw=1.2, label=f"#{number}")
    # the timeline's phases as one strip under the curve: why the curve has gaps
    for t in spent.attempts:
        for s in t.segments:
            width = (s.end - s.start) / scale
            strip.barh(0, width, left=(s.start - origin) / scale, color=PHASE_STYLE[s.phase][0], height=1)
    strip.set_yticks([0], ["phase"])
    strip.set_ylim(-0.5, 0.5)
    strip.set_xlabel(f"wall clock since the first submission ({unit})")
    ax.set_ylim(bottom=0)
    ax.set_ylabel("samples/s (per logging window)")
    ax.set_title(
        "throughput while training (the strip: each moment's phase, coloured as in the timeline)",
        loc="left",
        fontsize=11,
    )
    ax.grid(alpha=0.3)
    if len(keys) <= MAX_LABELLED_ATTEMPTS:
        ax.legend(title="attempt", fontsize=8, ncol=min(len(keys), 6), loc="lower right")
    return _png(fig)


# ---- per-rank own work per step (RUN/steptimes/) ------------------------------------------------


def ranks_figure(series: dict[int, list[tuple[int, float]]]) -> bytes | None:
    """Each rank's own work per step (compute and data, not the waiting in collectives, which makes
    every rank's step as long as the slowest): a straggler stands out above the others."""
    if not series:
        return None
    fig, ax = plt.subplots(figsize=(10, 3.6))
    for rank in sorted(series):
        steps, seconds = zip(*series[rank], strict=True)
        ax.plot(steps, [1000 * t for t in seconds], lw=1, marker=".", label=f"rank {rank}")
    ax.set_xlabel("step")
    ax.set_ylabel("own work per step (ms)")
    ax.set_ylim(0, 1.15 * 1000 * max(t for pts in series.values() for _, t in pts))
    ax.set_title(
        "own work per step, per rank (a straggler stands out above the others)", loc="left", fontsize=11
    )
    ax.grid(alpha=0.3)
    if len(series) <= 16:
        ax.legend(fontsize=8, ncol=min(len(series), 8))
    return _png(fig)


# ---- a sweep: its points side by side ----------------------------------------------------------


class SweepCurve(NamedTuple):
    """One point of a sweep as its figure shows it."""

    name: str
    state: str
    goodput: float | None
    lines: list[MetricsLine]


def sweep_figure(points: list[SweepCurve]) -> bytes | None:
    """Loss against step of every point, and each point's goodput."""
    if not any(p.lines for p in points):
        return None
    return _png(sweep_axes(points))


def sweep_axes(points: list[SweepCurve]) -> Figure:
    """The sweep figure, not yet rendered. Constrained layout: the right panel's point names get
    their own room instead of running into the left panel and its legend."""
    fig, (ax, bars) = plt.subplots(
        1, 2, figsize=(11, 4.4), gridspec_kw={"width_ratios": [2.2, 1]}, layout="constrained"
    )
    for point in points:
        latest: dict[int, float] = {}
        for line in point.lines:  # a step computed twice (lost to a crash) shows its kept value
            if line.loss is not None and line.step is not None:
                latest[line.step] = float(line.loss)
        if latest:
            steps = sorted(latest)
            ax.plot(steps, [latest[s] for s in steps], lw=1.4, label=point.name)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("loss of every point", loc="left", fontsize=11)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    names = [p.name for p in points]
    ratios = [float(p.goodput or 0.0) for p in points]
    bars.barh(range(len(names)), ratios, color=PHASE_STYLE["training"][0])
    for i, (ratio, p) in enumerate(zip(ratios, points, strict=True)):
        bars.text(ratio, i, f" {ratio:.0%} ({p.state})", va="center", fontsize=8)
    bars.set_yticks(range(len(names)), names, fontsize=8)
    bars.invert_yaxis()
    bars.set_xlim(0, 1.35)
    bars.set_xlabel("goodput (kept training / allocated time)")
    bars.set_title("goodput of every point", loc="left", fontsize=11)
    return fig
