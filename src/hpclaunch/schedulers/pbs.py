"""PBS Pro / OpenPBS / Torque: a Jinja2 template rendered from the plan, submitted with ``qsub``.

A sibling of the SLURM module, not a fork: same plan, same lint, its own directive dialects
(PBS Pro ``select=N:ncpus=C:ngpus=G:mpiprocs=1`` + ``place=scatter``, ``-J`` arrays; Torque
``nodes=N:ppn=C:gpus=G``, ``-t`` arrays). PBS users cannot requeue their own job (``qrerun`` needs
operator rights), so a stopped run continues through a continuation job submitted from inside the
job: ``qsub -W depend=afterany:$PBS_JOBID``.
"""

from __future__ import annotations

import re
import socket
import subprocess
from collections.abc import Mapping
from pathlib import Path

from ..config import format_hms
from ..errors import SchedulerError
from ..rundir import JobPlan, RunPaths, read_events
from ..rundir.env import NODE_RANK_VAR
from ..rundir.ledger import STARTED
from ..templates import jinja, lint
from ..templates.shell import Raw, directive_value, export_line, join
from .base import (
    Continuation,
    JobState,
    NodeContext,
    NodeContextError,
    RenderedJob,
    SchedulerStatus,
    at_time_limit,
    end_time_from_env,
    env_int,
    mem_directive,
    run_command,
)
from .nodes import resolve_address

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
    mem = mem_directive(plan.mem_gb, lower=True)
    n = len(run_dirs)
    array_spec = ""
    if n > 1:
        array_spec = f"0-{n - 1}" + (f"%{plan.array_parallelism}" if plan.array_parallelism else "")
    log_dir = str(Path(plan.run_dir) / "logs") + "/"
    extra = lint.extra_directives(plan.extra_directives, "#PBS")
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
    findings = lint.lint_pbs(text, generated_lines=generated, plan=plan)
    warnings = lint.enforce(findings, script_name=SCRIPT_NAME)
    return RenderedJob(text=text, filename=SCRIPT_NAME, warnings=[w.message for w in warnings])


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

    # ---- allocation side ------------------------------------------------------------------------

    # PBS Pro can place a job on named hosts only, not "anywhere but these": a continuation that
    # avoids a node is not expressible in general (the ledger and status say so).
    can_exclude_nodes = False

    def node_context(self, plan: JobPlan, environ: Mapping[str, str], *, now: float) -> NodeContext:
        ctx = node_context_from_env(environ, time_limit_s=plan.time_limit_s, now=now)
        # PBS has no restart counter: each continuation is a new job, counted in the ledger.
        earlier = {e.get("job_id") for e in read_events(plan.paths()).named(STARTED)}
        return NodeContext(**{**ctx.__dict__, "restart_count": len(earlier - {ctx.job_id})})

    def node_address(self, host: str) -> str:
        return resolve_address(host)

    def termination_cause(self, paths: RunPaths, ctx: NodeContext, *, now: float) -> str:
        # A walltime kill comes at the end; qdel, qrerun and preemption all arrive as SIGTERM
        # before it (`hpclaunch cancel` records its own ledger event, which the decision reads).
        return "timeout" if at_time_limit(ctx, now) else "preemption"

    def continue_job(self, plan: JobPlan, paths: RunPaths, ctx: NodeContext) -> Continuation:
        """Submit the continuation: the same run's script, starting once this job has ended."""
        script = paths.root / SCRIPT_NAME
        return Continuation(
            qsub(["-W", f"depend=afterany:{ctx.job_id}", str(script)], cwd=paths.scheduler_dir)
        )

    def exclude_nodes(
        self, plan: JobPlan, paths: RunPaths, ctx: NodeContext, nodes: list[str]
    ) -> Continuation:
        raise SchedulerError("PBS cannot keep a continuation off named nodes", where="exclude")

    def withdraw(self, paths: RunPaths, ctx: NodeContext) -> str:
        _run(["qdel", ctx.job_id], what="qdel")
        return f"deleted job {ctx.job_id}"


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


# ---- inside the job -----------------------------------------------------------------------------

_MPI_RANK_VARS = ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK", "PALS_RANKID", "MPI_RANK")


def node_context_from_env(environ: Mapping[str, str], *, time_limit_s: int, now: float) -> NodeContext:
    """This node of the job, from PBS's variables, ``PBS_NODEFILE`` and the launcher's rank."""
    if "PBS_JOBID" not in environ:
        raise NodeContextError("PBS_JOBID is not set", hint="is this running inside a PBS job?")
    hosts = tuple(read_pbs_nodefile(environ.get("PBS_NODEFILE")))
    hostname = socket.gethostname().split(".")[0]
    if not hosts:
        # Slurm's Torque emulation and some single-node sites set no PBS_NODEFILE: a one-node job
        # runs on this host. Several nodes without a node file cannot be placed: fail.
        hosts = (hostname,)
    node_rank: int | None = None
    if environ.get(NODE_RANK_VAR):
        node_rank = env_int(environ, NODE_RANK_VAR)
    else:
        for name in _MPI_RANK_VARS:
            if environ.get(name):
                node_rank = env_int(environ, name)
                break
    if node_rank is None:
        short = [h.split(".")[0] for h in hosts]
        if hostname in short:
            node_rank = short.index(hostname)
        elif len(hosts) == 1:
            node_rank = 0
        else:
            raise NodeContextError(
                f"cannot tell which of the {len(hosts)} PBS nodes this is (host {hostname} is not in "
                f"PBS_NODEFILE and no MPI rank variable is set)",
                hint="launch one agent per node with mpiexec --ppn 1 or pbsdsh -u",
            )
    array = environ.get("PBS_ARRAY_INDEX") or environ.get("PBS_ARRAYID")
    return NodeContext(
        scheduler="pbs",
        job_id=environ["PBS_JOBID"],
        node_rank=node_rank,
        num_nodes=len(hosts),
        hostname=hosts[node_rank] if node_rank < len(hosts) else hostname,
        hosts=hosts,
        end_time=end_time_from_env(environ, time_limit_s=time_limit_s, now=now),
        array_task=int(array) if array else None,
    )


def read_pbs_nodefile(path: str | None) -> list[str]:
    """Unique hosts of ``PBS_NODEFILE`` in first-seen order (PBS lists a host once per slot)."""
    if not path:
        return []
    try:
        lines = Path(path).read_text().split()
    except OSError as e:
        raise NodeContextError(f"cannot read PBS_NODEFILE {path} ({e.strerror})") from None
    return list(dict.fromkeys(line.strip() for line in lines if line.strip()))
