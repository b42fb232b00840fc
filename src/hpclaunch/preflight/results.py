"""What a preflight run found: one result per check, and the report that holds them.

A check ends in one of four states (``Status``, a ``str`` so ``result.status == "fail"`` works):
pass, warn (the run can start but something looks off), fail (the run would not work: ``submit``
refuses, the node agent ends the attempt), skip (not applicable here, with the reason as finding).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TypedDict

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ..rundir.cause import RecordedEnum
from ..rundir.events import CheckRow


class Status(RecordedEnum):
    PASS = "pass"
    WARN = "warn"
    FAIL = "fail"
    SKIP = "skip"

    @property
    def rank(self) -> int:
        """Severity order: a check's status is the worst of its findings."""
        return {"skip": 0, "pass": 1, "warn": 2, "fail": 3}[self.value]


_STYLE = {Status.PASS: "green", Status.WARN: "yellow", Status.FAIL: "bold red", Status.SKIP: "dim"}


class CheckResultJSON(CheckRow):
    hint: str | None
    seconds: float


class ReportJSON(TypedDict):
    """``preflight --json``'s checks (the CLI adds the estimate)."""

    ok: bool
    checks: list[CheckResultJSON]
    seconds: float


@dataclass(frozen=True)
class CheckResult:
    name: str
    status: Status
    finding: str  # one line
    hint: str | None = None  # what to do (fail/warn), or None
    seconds: float = 0.0

    def to_dict(self) -> CheckResultJSON:
        return {
            "name": self.name,
            "status": self.status.value,
            "finding": self.finding,
            "hint": self.hint,
            "seconds": round(self.seconds, 3),
        }


@dataclass
class Report:
    """All results of one preflight run, in check order."""

    checks: list[CheckResult]
    seconds: float
    where: str = "login"  # login | node <hostname>

    @property
    def failed(self) -> list[CheckResult]:
        """The failed checks (empty, hence falsy, when nothing failed)."""
        return [c for c in self.checks if c.status is Status.FAIL]

    @property
    def warnings(self) -> list[CheckResult]:
        return [c for c in self.checks if c.status is Status.WARN]

    @property
    def ok(self) -> bool:
        return not self.failed

    def get(self, name: str) -> CheckResult:
        for c in self.checks:
            if c.name == name:
                return c
        raise KeyError(name)

    def to_json(self) -> ReportJSON:
        """``{"ok", "checks": [{name, status, finding, hint, seconds}], "seconds"}`` (JSON-ready dict)."""
        return {
            "ok": self.ok,
            "checks": [c.to_dict() for c in self.checks],
            "seconds": round(self.seconds, 3),
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2)

    def summary(self) -> str:
        counts = {s: sum(1 for c in self.checks if c.status is s) for s in Status}
        parts = [f"{n} {s.value}" for s, n in counts.items() if n]
        verdict = "FAILED" if self.failed else "ok"
        return f"preflight ({self.where}) {verdict}: {', '.join(parts)} in {self.seconds:.1f} s"

    def table(self) -> Table:
        table = Table(title=f"preflight ({self.where})", title_justify="left", expand=False)
        table.add_column("check", style="bold")
        table.add_column("status")
        table.add_column("finding", overflow="fold")
        table.add_column("hint", overflow="fold", style="dim")
        table.add_column("s", justify="right", style="dim")
        for c in self.checks:
            table.add_row(
                c.name,
                f"[{_STYLE[c.status]}]{c.status.value}[/]",
                escape(c.finding),
                escape(c.hint or ""),
                f"{c.seconds:.1f}",
            )
        return table

    def lines(self) -> list[str]:
        """The report for a file or a pipe (a log): a line per check and one per hint, as long as
        what they say; a table there pads every row to its longest finding (~600 characters)."""
        width = max((len(c.name) for c in self.checks), default=0)
        out = [f"preflight ({self.where})"]
        for c in self.checks:
            out.append(f"  {c.name:<{width}}  {c.status.value:<4}  {c.finding}")
            if c.hint:
                out.append(f"  {'':<{width}}        hint: {c.hint}")
        return out


def print_report(report: Report, *, console: Console | None = None) -> None:
    """The rich table in a terminal, plain lines elsewhere, and a one-line verdict."""
    console = console or Console()
    if console.is_terminal:
        console.print(report.table())
    else:
        for line in report.lines():
            console.print(line, markup=False, highlight=False, soft_wrap=True)
    style = "bold red" if report.failed else "green"
    console.print(f"[{style}]{escape(report.summary())}[/]")
