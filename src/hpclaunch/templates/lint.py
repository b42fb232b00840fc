"""Lint of a rendered job script: runs on every render, refuses or warns with a reason.

It reads the script text itself (the directives that the scheduler will read), so it checks what
will really be submitted, including the user's ``extra_directives``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from ..config import parse_duration
from ..errors import ScriptLintError

if TYPE_CHECKING:
    from ..rundir import JobPlan

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


def extra_directives(lines: list[str], prefix: str) -> list[str]:
    """The user's ``scheduler.extra_directives``, each a whole ``#SBATCH ...``/``#PBS ...`` line."""
    out = []
    for line in lines:
        line = line.strip()
        if not line.startswith(prefix + " "):
            example = "'#SBATCH --mail-type=END'" if prefix == "#SBATCH" else "'#PBS -m abe'"
            raise ScriptLintError(
                f"extra directive {line!r} does not start with '{prefix} '",
                where="scheduler.extra_directives",
                hint=f"give whole lines, e.g. {example}",
            )
        out.append(line)
    return out


# hpclaunch's own mechanism: an extra directive may never change these.
_SLURM_RESERVED = ("--signal", "--open-mode", "--requeue", "--no-requeue")
_OPPOSITES = {"--no-requeue": ("--requeue", "--no-requeue"), "--requeue": ("--no-requeue", "--requeue")}


def lint_slurm(script: str, *, generated_lines: int, plan: JobPlan) -> list[LintFinding]:
    """``generated_lines``: directives up to this line number are hpclaunch's own; later ones are
    the user's ``extra_directives``."""
    findings: list[LintFinding] = []
    directives = sbatch_directives(script)
    ours = {k: v for k, v, n in directives if n <= generated_lines}
    for key, value, number in directives:
        if number > generated_lines:
            findings += _check_extra_sbatch(key, value, number, ours, plan)
    if ours.get("--ntasks-per-node") != "1":
        findings.append(
            LintFinding("error", "the node agent needs exactly one task per node (--ntasks-per-node=1)")
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
    findings += _common_time_checks(plan)
    minutes = ours.get("--time")
    if minutes and minutes.isdigit() and int(minutes) * 60 != plan.time_limit_s:
        findings.append(
            LintFinding(
                "warning",
                f"SLURM counts whole minutes: the time limit {plan.time_limit_s} s becomes {minutes} min",
            )
        )
    return findings


def _check_extra_sbatch(
    key: str, value: str | None, number: int, ours: dict[str, str | None], plan: JobPlan
) -> list[LintFinding]:
    shown = f"{key}{'=' + value if value else ''}"

    def contradicts(why: str) -> list[LintFinding]:
        return [
            LintFinding(
                "error",
                f"extra directive '{shown}' (line {number}) contradicts {why}; set it through the config key instead",
            )
        ]

    if key in _SLURM_RESERVED:
        # name the directive the script has: --no-requeue contradicts the generated --requeue
        mine = next((k for k in _OPPOSITES.get(key, (key,)) if k in ours), key)
        return contradicts(f"the generated one ({mine}{'=' + str(ours[mine]) if ours.get(mine) else ''})")
    if key == "--export" and plan.pass_env and not (value or "").upper().startswith("ALL"):
        return [
            LintFinding(
                "error",
                f"extra directive '{shown}' (line {number}) drops the submitting environment, so "
                f"launch.pass_env ({', '.join(plan.pass_env)}) would never reach the job; "
                "use --export=ALL (the default) or remove launch.pass_env",
            )
        ]
    if key == "--ntasks" and value != str(plan.allocation_nodes):
        return contradicts(f"the plan's one task per node ({plan.allocation_nodes} tasks)")
    if key == "--ntasks-per-node" and value != "1":
        return contradicts("the plan's one task (the node agent) per node")
    if key == "--nodes" and value != str(plan.allocation_nodes):
        spares = f" + scheduler.spare_nodes={plan.spare_nodes}" if plan.spare_nodes else ""
        return contradicts(f"scheduler.nodes={plan.nodes}{spares}")
    if key == "--gres" and value is not None:
        gpus = [
            int(m.group(1)) for part in value.split(",") if (m := re.fullmatch(r"gpu(?::[^:]+)?:(\d+)", part))
        ]
        if gpus and gpus[0] != plan.gpus_per_node:
            return contradicts(f"scheduler.gpus_per_node={plan.gpus_per_node}")
        return []
    if key in ours:
        if value == ours[key]:
            return [
                LintFinding("warning", f"extra directive '{shown}' (line {number}) repeats the generated one")
            ]
        return contradicts(f"the generated one ({key}{'=' + str(ours[key]) if ours.get(key) else ''})")
    return []


def lint_pbs(script: str, *, generated_lines: int, plan: JobPlan) -> list[LintFinding]:
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
    if walltime and parse_duration(walltime) != plan.time_limit_s:
        findings.append(
            LintFinding("error", f"walltime {walltime} differs from the plan's {plan.time_limit_s} s")
        )
    body = script.split("\n\n", 1)[-1]
    # one agent per node: mpiexec --ppn 1, PBS Pro's pbsdsh (one task per select chunk, each
    # mpiprocs=1), Torque's pbsdsh -u (one task per unique node)
    if plan.allocation_nodes > 1 and not re.search(r"(mpiexec -n \d+ --ppn 1|pbsdsh (-u )?--)", body):
        findings.append(LintFinding("error", "a multi-node PBS job must start exactly one agent per node"))
    if re.search(r"^\s*torchrun\b", body, re.M):
        findings.append(
            LintFinding(
                "error", "torchrun in the batch script: the node agent starts the ranks (its rank host)"
            )
        )
    if plan.exclude and not plan.hosts:
        findings.append(
            LintFinding(
                "warning",
                f"scheduler.exclude {','.join(plan.exclude)} is not applied: a PBS select can name the hosts "
                "of a job, not exclude some (a continuation that must avoid a node names healthy ones)",
            )
        )
    findings += _common_time_checks(plan)
    return findings


def _common_time_checks(plan: JobPlan) -> list[LintFinding]:
    findings = []
    time_limit_s, lead = plan.time_limit_s, plan.planned_stop_lead_s
    if time_limit_s <= lead:
        findings.append(
            LintFinding(
                "error", f"walltime {time_limit_s} s is not longer than the stop lead time {lead:.0f} s"
            )
        )
    elif time_limit_s < 2 * lead:
        findings.append(
            LintFinding(
                "warning",
                f"walltime {time_limit_s} s leaves under half of each attempt for training (stop lead {lead:.0f} s)",
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
