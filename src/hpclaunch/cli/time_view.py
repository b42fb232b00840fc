"""What ``status`` shows of where a run's wall-clock time went (``orchestrator.accounting``):
the per-attempt table, the goodput lines (time first, steps beside) and the start-up summary."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..orchestrator.accounting import AttemptTime, RunTime
    from ..orchestrator.status import StatusView

_PHASE_COLUMNS = (
    ("queue", "queue"),
    ("startup", "start-up"),
    ("training", "training"),
    ("stall", "stall"),
    ("lost", "lost"),
    ("end_save", "end save"),
    ("idle", "idle"),
)


def time_parts(data: StatusView) -> list[Any]:
    """The time table (per attempt and the run) and the goodput lines: time first, steps beside."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    from ..orchestrator.accounting import fmt_seconds

    spent = data.time
    # Seconds without units and no vertical rules: ten columns fit an 80-column terminal.
    table = Table(
        title="time in seconds (wall clock)",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        padding=(0, 0, 0, 1),
        show_edge=False,
        pad_edge=False,
    )
    for col in ("#", *(label for _, label in _PHASE_COLUMNS), "allocated", "goodput"):
        table.add_column(col, justify="left" if col == "#" else "right")

    def row(label: str, t: AttemptTime | RunTime, *, style: str | None = None) -> None:
        cells = []
        for phase, _ in _PHASE_COLUMNS:
            value = getattr(t, f"{phase}_s")
            cells.append(f"{value:.1f}" if value else "-")
        ratio = t.goodput
        table.add_row(
            label,
            *cells,
            f"{t.allocated_s or 0.0:.1f}",
            f"{ratio:.1%}" if ratio is not None else "-",
            style=style,
        )

    for i, a in enumerate(spent.attempts, 1):
        row(f"{i}" + ("*" if a.running else ""), a)
    if len(spent.attempts) > 1:
        row("run", spent, style="bold")
    gp = data.step_counts
    ratio = spent.goodput
    lines: list[Any] = [table] if spent.attempts else []
    if ratio is not None:
        lines.append(
            Text(
                f"goodput {ratio:.1%} of {fmt_seconds(spent.allocated_s)} allocated became kept training"
                f"; {fmt_seconds(spent.queue_s or 0.0)} waiting in the queue, not counted as allocated",
                style="bold",
            )
        )
    lines.append(
        Text(
            f"steps: {gp.useful_steps} kept of {gp.computed_steps} computed ({gp.kept_ratio:.1%}); "
            f"{gp.repeated_steps} computed again after a crash, {gp.lost_steps} skipped; "
            f"requeues {data.requeues}"
        )
    )
    for i, a in enumerate(spent.attempts, 1):
        if a.lost_steps:
            steps = (
                f"step {a.last_step} was"
                if a.lost_steps == 1
                else f"steps {(a.kept_step or 0) + 1}-{a.last_step} were"
            )
            lines.append(
                Text(
                    f"attempt {i} lost {a.lost_steps} step{'s' if a.lost_steps != 1 else ''} "
                    f"({fmt_seconds(a.lost_s)}): {steps} computed after its last checkpoint "
                    f"(step {a.kept_step}); {_again(data, i == len(spent.attempts))}",
                    style="yellow",
                )
            )
    startup = _startup_summary(spent.attempts)
    if startup:
        lines.append(Text(f"start-up, all attempts: {startup}"))
    return lines


def _again(data: StatusView, last: bool) -> str:
    """What becomes of an attempt's lost steps: a later attempt computed them again, or the next one
    will; where the run has ended (stopped for good, failed, cancelled), only a resume would."""
    from ..schedulers.protocol import ACTIVE_STATES

    if not last:
        return "a later attempt computed them again"
    if data.state in ACTIVE_STATES:
        return "the next attempt computes them again"
    return f"a resume would compute them again (the run is {data.state})"


_STARTUP_LABELS = {
    "scheduler": "job start",
    "node_checks": "node checks",
    "launch": "launch (rank host, rendezvous, fork)",
    "trainer": "trainer (launch, imports, rendezvous, smoke test, data, model, load)",
}


def _startup_summary(attempts: list[AttemptTime]) -> str:
    from ..orchestrator.accounting import fmt_seconds

    total: dict[str, float] = {}
    for a in attempts:
        for name, seconds in a.startup_parts.items():
            total[name] = total.get(name, 0.0) + float(seconds)
    return ", ".join(f"{_STARTUP_LABELS.get(k, k)} {fmt_seconds(v)}" for k, v in total.items() if v >= 0.05)
