"""Lint of a rendered job script: runs on every render, refuses or warns with a reason.

It reads the script text itself (the directives that the scheduler will read), so it checks what
will really be submitted, including the user's ``extra_directives``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from ..config import parse_duration
from ..errors import ScriptLintError

Severity = Literal["error", "warning"]


@dataclass(frozen=True)
class LintFinding:
    severity: Severity
    message: str

    def __str__(self) -> str:
        return f"{self.severity}: {self.message}"


def sbatch_directives(script: str) -> list[tuple[str, str | None, int]]:
    """(option, value, line number) for every ``#SBATCH`` line before the first command."""
    out: list[tuple[str, str | None, int]] = []
    for number, line in enumerate(script.splitlines(), 1):
        stripped = line.strip()
        if stripped and not stripped.startswith("#"):
            break  # sbatch stops reading directives at the first command
        if not stripped.startswith("#SBATCH"):
            continue
        for token in stripped[len("#SBATCH") :].split():
            if token.startswith("#"):
                break
            key, eq, value = token.partition("=")
            out.append((_canonical(key), value if eq else None, number))
    return out


_SHORT = {
    "-N": "--nodes",
    "-n": "--ntasks",
    "-c": "--cpus-per-task",
    "-t": "--time",
    "-J": "--job-name",
    "-p": "--partition",
    "-A": "--account",
    "-o": "--output",
    "-e": "--error",
    "-a": "--array",
    "-x": "--exclude",
    "-C": "--constraint",
    "-q": "--qos",
    "-G": "--gpus",
}


def _canonical(key: str) -> str:
    return _SHORT.get(key, key)


def pbs_directives(script: str) -> list[tuple[str, str, int]]:
    """(flag, argument, line number) for every ``#PBS`` line; ``-l`` resources split per key."""
    out: list[tuple[str, str, int]] = []
    for number, line in enumerate(script.splitlines(), 1):
        stripped = line.strip()
        if stripped and not stripped.startswith("#"):
            break
        if not stripped.startswith("#PBS"):
            continue
        parts = stripped[len("#PBS") :].split(None, 1)
        if not parts:
            continue
        flag, arg = parts[0], (parts[1].strip() if len(parts) > 1 else "")
        if flag == "-l":
            for resource in arg.split(","):
                key = resource.split("=", 1)[0].strip()
                out.append((f"-l {key}", resource.strip(), number))
        else:
            out.append((flag, arg, number))
    return out


def lint_slurm(
    script: str, *, generated_lines: int, time_limit_s: int, stop_lead_s: int | None, warn_lead_s: int
) -> list[LintFinding]:
    """``generated_lines``: directives up to this line number are hpclaunch's own; later ones are
    the user's ``extra_directives``."""
    findings: list[LintFinding] = []
    directives = sbatch_directives(script)
    ours = {k: v for k, v, n in directives if n <= generated_lines}
    for key, value, number in directives:
        if number <= generated_lines:
            continue
        if key in ours or key in (
            "--ntasks-per-node",
            "--signal",
            "--open-mode",
            "--requeue",
            "--no-requeue",
        ):
            findings.append(
                LintFinding(
                    "error",
                    f"extra directive '{key}{'=' + value if value else ''}' (line {number}) contradicts "
                    f"the generated one{' (' + key + '=' + str(ours[key]) + ')' if ours.get(key) else ''}; "
                    "set it through the config key instead",
                )
            )
    if ours.get("--ntasks-per-node") != "1":
        findings.append(
            LintFinding("error", "torchrun needs exactly one task per node (--ntasks-per-node=1)")
        )
    if ours.get("--open-mode") != "append":
        findings.append(
            LintFinding("error", "--open-mode=append is missing: a requeue would truncate the logs")
        )
    signal = ours.get("--signal") or ""
    if signal.startswith("B:"):
        findings.append(
            LintFinding("error", "--signal with B: reaches only the batch shell, never the node agent")
        )
    if not re.fullmatch(r"(USR1|USR2|SIGUSR1|SIGUSR2)@\d+", signal):
        findings.append(
            LintFinding("error", f"--signal={signal or '(none)'}: the warning must be USR1/USR2@seconds")
        )
    findings += _common_time_checks(time_limit_s, stop_lead_s, warn_lead_s)
    minutes = ours.get("--time")
    if minutes and minutes.isdigit() and int(minutes) * 60 != time_limit_s:
        findings.append(
            LintFinding(
                "warning",
                f"SLURM counts whole minutes: the time limit {time_limit_s} s becomes {minutes} min",
            )
        )
    return findings


def lint_pbs(
    script: str,
    *,
    generated_lines: int,
    nodes: int,
    time_limit_s: int,
    stop_lead_s: int | None,
    warn_lead_s: int,
) -> list[LintFinding]:
    findings: list[LintFinding] = []
    directives = pbs_directives(script)
    ours = {k: v for k, v, n in directives if n <= generated_lines}
    for key, value, number in directives:
        if number > generated_lines and key in ours:
            findings.append(
                LintFinding(
                    "error",
                    f"extra directive '#PBS {value}' (line {number}) contradicts the generated '{ours[key]}'; "
                    "set it through the config key instead",
                )
            )
    walltime = ours.get("-l walltime", "").partition("=")[2]
    if walltime and parse_duration(walltime) != time_limit_s:
        findings.append(LintFinding("error", f"walltime {walltime} differs from the plan's {time_limit_s} s"))
    body = script.split("\n\n", 1)[-1]
    if nodes > 1 and not re.search(r"(mpiexec -n \d+ --ppn 1|pbsdsh -u)", body):
        findings.append(LintFinding("error", "a multi-node PBS job must start exactly one agent per node"))
    if re.search(r"^\s*torchrun\b", body, re.M):
        findings.append(
            LintFinding("error", "torchrun is started by the node agent, not by the batch script")
        )
    findings += _common_time_checks(time_limit_s, stop_lead_s, warn_lead_s)
    return findings


def _common_time_checks(time_limit_s: int, stop_lead_s: int | None, warn_lead_s: int) -> list[LintFinding]:
    findings = []
    lead = stop_lead_s if stop_lead_s is not None else warn_lead_s
    if time_limit_s <= lead:
        findings.append(
            LintFinding("error", f"walltime {time_limit_s} s is not longer than the stop lead time {lead} s")
        )
    elif time_limit_s < 2 * lead:
        findings.append(
            LintFinding(
                "warning",
                f"walltime {time_limit_s} s leaves under half of each attempt for training (stop lead {lead} s)",
            )
        )
    return findings


def enforce(findings: list[LintFinding], *, script_name: str) -> list[LintFinding]:
    """Raise on the first error; return the warnings for the caller to show."""
    errors = [f for f in findings if f.severity == "error"]
    if errors:
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise ScriptLintError(
            errors[0].message + more, where=script_name, hint="fix the config; nothing was written"
        )
    return [f for f in findings if f.severity == "warning"]
