"""PBS Pro / OpenPBS / Torque: a Jinja2 template rendered from the plan, submitted with ``qsub``.

A sibling of the SLURM module, not a fork: same plan, same lint, its own directive dialects
(PBS Pro ``select=N:ncpus=C:ngpus=G:mpiprocs=1`` + ``place=scatter``, ``-J`` arrays; Torque
``nodes=N:ppn=C:gpus=G``, ``-t`` arrays). PBS users cannot requeue their own job (``qrerun`` needs
operator rights), so a stopped run continues through a continuation job submitted from inside the
job: ``qsub -W depend=afterany:$PBS_JOBID``.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

from ...config import format_hms
from ...errors import SchedulerError
from ...templates import jinja, lint
from ...templates.shell import Raw, directive_value, export_line, join
from .base import JobState, RenderedJob, SchedulerStatus, run_command

if TYPE_CHECKING:
    from ...jobs.env import NodeContext
    from ..plan import JobPlan
    from ..runs import RunPaths

SCRIPT_NAME = "job.pbs"

STATE_MAP: dict[str, JobState] = {
    "Q": JobState.PENDING,
    "H": JobState.PENDING,
    "W": JobState.PENDING,
    "T": JobState.PENDING,
    "S": JobState.PENDING,
    "R": JobState.RUNNING,
    "E": JobState.RUNNING,  # exiting
    "B": JobState.RUNNING,  # array with running subjobs
    "C": JobState.COMPLETED,
    "F": JobState.COMPLETED,
    "X": JobState.COMPLETED,
}


def _mem(plan: JobPlan) -> str | None:
    if not plan.mem_gb:
        return None
    return f"{int(plan.mem_gb)}gb" if plan.mem_gb == int(plan.mem_gb) else f"{int(plan.mem_gb * 1024)}mb"


def render_pbs(plan: JobPlan, *, single_run_dir: str | None = None) -> RenderedJob:
    """The PBS script; ``single_run_dir`` renders one point of a sweep as a plain (non-array) job."""
    run_dirs = [single_run_dir] if single_run_dir else ([p.run_dir for p in plan.sweep] or [plan.run_dir])
    for d in run_dirs:
        directive_value(d, what="run_dir")
    for key in ("partition", "account"):
        value = getattr(plan, key)
        if value:
            directive_value(value, what=f"scheduler.{key}")
    gpus_key = "ngpus" if plan.pbs_dialect == "pro" else "gpus"
    gpus_part = f":{gpus_key}={plan.gpus_per_node}" if plan.gpus_per_node else ""
    mem = _mem(plan)
    n = len(run_dirs)
    array_spec = ""
    if n > 1:
        array_spec = f"0-{n - 1}" + (f"%{plan.array_parallelism}" if plan.array_parallelism else "")
    log_dir = str(Path(plan.run_dir) / "logs") + "/"
    extra = [_extra_directive(d) for d in plan.extra_directives]
    text = jinja.render(
        "pbs.sh.j2",
        version=plan.hpclaunch_version,
        config_hash=plan.config_hash,
        name=plan.name,
        queue=plan.partition,
        account=plan.account,
        walltime=format_hms(plan.time_limit_s),
        dialect=plan.pbs_dialect,
        nodes=plan.nodes,
        cpus=plan.cpus_per_task,
        gpus_part=gpus_part,
        mem_part=f":mem={mem}" if mem and plan.pbs_dialect == "pro" else (mem or ""),
        mem=mem or "",
        log_dir=log_dir,
        array_flag="-J" if plan.pbs_dialect == "pro" else "-t",
        array_spec=array_spec,
        pass_env=plan.pass_env,
        extra_directives=extra,
        run_dirs=run_dirs,
        setup=plan.setup,
        exports=[Raw(export_line(name, value)) for name, value in sorted(plan.env.items())],
        launcher=plan.pbs_launcher,
        agent_cmd=Raw(join(plan.agent_argv()[:-1])),
    )
    generated = max(
        i for i, line in enumerate(text.splitlines(), 1) if line.startswith("#PBS") and line not in extra
    )
    findings = lint.lint_pbs(
        text,
        generated_lines=generated,
        nodes=plan.nodes,
        time_limit_s=plan.time_limit_s,
        stop_lead_s=plan.stop_lead_s,
        warn_lead_s=plan.warn_lead_s,
    )
    warnings = lint.enforce(findings, script_name=SCRIPT_NAME)
    return RenderedJob(text=text, filename=SCRIPT_NAME, warnings=[w.message for w in warnings])


def _extra_directive(line: str) -> str:
    line = line.strip()
    if not line.startswith("#PBS "):
        from ...errors import ScriptLintError

        raise ScriptLintError(
            f"extra directive {line!r} does not start with '#PBS '",
            where="scheduler.extra_directives",
            hint="give whole lines, e.g. '#PBS -m abe'",
        )
    return line


class PbsScheduler:
    kind = "pbs"

    def render(self, plan: JobPlan) -> RenderedJob:
        return render_pbs(plan)

    def submit(self, plan: JobPlan, rendered: RenderedJob) -> str:
        script = Path(plan.run_dir) / rendered.filename
        return qsub([str(script)], cwd=Path(plan.run_dir) / "scheduler")

    def status(self, paths: RunPaths, job_id: str) -> SchedulerStatus:
        return pbs_status(job_id)

    def cancel(self, paths: RunPaths, job_id: str) -> None:
        _run(["qdel", job_id], what="qdel")

    def termination_cause(self, paths: RunPaths, ctx: NodeContext, cause: str) -> str | None:
        # qdel and a preemption both arrive as SIGTERM; `hpclaunch cancel` records its own event.
        return None

    def continue_job(self, plan: JobPlan, paths: RunPaths, ctx: NodeContext) -> str:
        """Submit the continuation: the same run's script, starting once this job has ended."""
        script = paths.root / SCRIPT_NAME
        return qsub(["-W", f"depend=afterany:{ctx.job_id}", str(script)], cwd=paths.scheduler_dir)


def qsub(args: list[str], *, cwd: Path) -> str:
    cwd.mkdir(parents=True, exist_ok=True)
    out = _run(["qsub", *args], what="qsub", cwd=cwd)
    job_id = out.strip().splitlines()[-1].strip() if out.strip() else ""
    if not re.match(r"^\d+(\[\d*\])?(\.\S+)?$", job_id):
        raise SchedulerError(f"qsub answered {out.strip()!r}, not a job id", where="qsub")
    return job_id


def _run(argv: list[str], *, what: str, cwd: Path | None = None, timeout: float = 60) -> str:
    return run_command(argv, what=what, hint="is PBS (or Torque) installed here?", cwd=cwd, timeout=timeout)


def pbs_status(job_id: str) -> SchedulerStatus:
    """``qstat -f``: ``job_state = X`` (PBS Pro, Torque and Slurm's emulation all print it)."""
    try:
        out = subprocess.run(["qstat", "-f", job_id], capture_output=True, text=True, timeout=30)
    except (FileNotFoundError, subprocess.TimeoutExpired) as e:
        return SchedulerStatus(JobState.UNKNOWN, "", f"cannot ask PBS: {e}")
    m = re.search(r"job_state\s*=\s*(\w)", out.stdout)
    if out.returncode != 0 or not m:
        return SchedulerStatus(JobState.UNKNOWN, "", "PBS no longer lists the job")
    word = m.group(1).upper()
    return SchedulerStatus(STATE_MAP.get(word, JobState.UNKNOWN), word)
