"""PBS Pro / OpenPBS / Torque: a Jinja2 template rendered from the plan, submitted with ``qsub``.

A sibling of the SLURM module, not a fork: same plan, same lint, its own directive dialects
(PBS Pro ``select=N:ncpus=C:ngpus=G:mpiprocs=1`` + ``place=scatter``, ``-J`` arrays; Torque
``nodes=N:ppn=C:gpus=G``, ``-t`` arrays). PBS users cannot requeue their own job (``qrerun`` needs
operator rights), so a stopped run continues through a continuation job submitted from inside the
job: ``qsub -W depend=afterany:$PBS_JOBID``. What PBS itself does is read from its JSON
(``qstat -f -F json``, see ``pbs_json``): a ``qrerun`` or a preemption that requeues shows as
substate RERUN (PBS runs the same job again, so nothing is submitted), a ``qdel`` as the comment
"... terminated by USER@HOST" (never continued). Tested against a real OpenPBS 23.06
(``scripts/local-pbs``, ``tests/pbs``); Torque only under Slurm's Torque emulation.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
from collections.abc import Mapping
from pathlib import Path

from .. import proc
from ..config import format_hms
from ..errors import SchedulerError
from ..rundir import JobPlan, RunPaths, of_kind, read_events
from ..rundir.cause import Cause
from ..rundir.env import NODE_RANK_VAR, START_TIME_VAR
from ..rundir.events import Started
from ..rundir.plan import write_plan
from ..templates import jinja, lint
from ..templates.shell import Raw, directive_value, join, pbs_output_path
from . import pbs_json
from .batch import BatchCommands, BatchScheduler
from .nodes import resolve_address
from .protocol import (
    Continuation,
    JobState,
    NodeContext,
    NodeContextError,
    RenderedJob,
    SchedulerStatus,
    at_time_limit,
    env_int,
    mem_directive,
    spares_that_fit,
    write_script,
)
from .rescue_job import RESCUE_MINUTES, leave_rescue, rescue_body, rescue_header

SCRIPT_NAME = "job.pbs"
RESCUE_SCRIPT_NAME = "rescue.pbs"
RESCUE_FOR_VAR = "HPCLAUNCH_RESCUE_FOR"  # the job a rescue watches (qsub runs a script with no arguments)
COMMANDS = BatchCommands(
    release=("qrls",), cancel=("qdel",), cancelled="deleted", hint="is PBS (or Torque) installed here?"
)
_run = COMMANDS.run  # every command this module runs (its failure a SchedulerError with the hint)

# Where PBS has no JSON (Torque, Slurm's emulation) only the state letter is known.
STATE_MAP: dict[str, JobState] = {
    "Q": JobState.PENDING,
    "H": JobState.HELD,
    "W": JobState.PENDING,
    "T": JobState.PENDING,
    "S": JobState.SUSPENDED,
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
    for host in plan.hosts:
        directive_value(host, what="hosts")
    n = len(run_dirs)
    array_spec = ""
    if n > 1:
        array_spec = f"0-{n - 1}" + (f"%{plan.array_parallelism}" if plan.array_parallelism else "")
    log_dir = pbs_output_path(
        str(Path(plan.run_dir) / "logs") + "/", what="run_dir", dialect=plan.pbs_dialect
    )
    extra = lint.extra_directives(plan.extra_directives, "#PBS")
    text = jinja.render_job(
        "pbs.sh.j2",
        plan,
        name=plan.name,
        queue=plan.partition,
        account=plan.account,
        walltime=format_hms(plan.time_limit_s),
        dialect=plan.pbs_dialect,
        nodes=plan.allocation_nodes,
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
        launcher=plan.pbs_launcher,
        task_cmd=Raw(_task_cmd(plan)),
        select=Raw(select_spec(plan, mem)),
        # whole nodes (cpus_per_node: all): the chunk asks for the ranks' need, excl keeps the rest
        place="scatter:excl" if plan.whole_node else "scatter",
    )
    generated = max(
        i for i, line in enumerate(text.splitlines(), 1) if line.startswith("#PBS") and line not in extra
    )
    findings = lint.lint_pbs(text, generated_lines=generated, plan=plan)
    warnings = lint.enforce(findings, script_name=SCRIPT_NAME)
    return RenderedJob(text=text, filename=SCRIPT_NAME, warnings=[w.message for w in warnings])


def select_spec(plan: JobPlan, mem: str | None) -> str:
    """PBS Pro ``select``: N identical chunks, or one chunk per host when ``plan.hosts`` names them
    (PBS can name the hosts a job runs on, never the ones it must avoid)."""
    chunk = f"ncpus={plan.cpus_per_task}"
    if plan.gpus_per_node:
        chunk += f":ngpus={plan.gpus_per_node}"
    if mem:
        chunk += f":mem={mem}"
    if plan.hosts:
        if len(plan.hosts) != plan.allocation_nodes:
            raise SchedulerError(
                f"{len(plan.hosts)} host(s) named for a {plan.allocation_nodes}-node job", where="plan.hosts"
            )
        return "+".join(f"1:{chunk}:mpiprocs=1:host={h}" for h in plan.hosts)
    return f"{plan.allocation_nodes}:{chunk}:mpiprocs=1"


def rescue_qsub_args(job_id: str) -> list[str]:
    """How a rescue is handed over: held until ``job_id`` ends in a failed state (PBS deletes it
    when that can no longer happen), and told which job it watches."""
    return ["-W", f"depend=afternotok:{job_id}", "-v", f"{RESCUE_FOR_VAR}={job_id}"]


def render_rescue(plan: JobPlan) -> RenderedJob:
    """The rescue job's script (``schedulers.rescue_job``): one chunk of one CPU, a few minutes, the
    run's account, ``scheduler.rescue``'s queue and GPUs; its output in the run's scheduler folder."""
    name = directive_value(f"{plan.name}-rescue", what="name")
    log = pbs_output_path(
        str(Path(plan.run_dir) / "scheduler") + "/", what="run_dir", dialect=plan.pbs_dialect
    )
    r = plan.rescue
    if plan.pbs_dialect == "pro":
        size = "select=1:ncpus=1" + (f":ngpus={r.gpus}" if r.gpus else "")
    else:
        size = "nodes=1:ppn=1" + (f":gpus={r.gpus}" if r.gpus else "")
    lines = [
        *rescue_header(plan, f"qsub {' '.join(rescue_qsub_args('JOB'))} {RESCUE_SCRIPT_NAME}"),
        f"#PBS -N {name}",
    ]
    if r.partition:
        lines.append(f"#PBS -q {directive_value(r.partition, what='scheduler.rescue.partition')}")
    if plan.account:
        lines.append(f"#PBS -A {directive_value(plan.account, what='scheduler.account')}")
    lines += [
        f"#PBS -l walltime={format_hms(RESCUE_MINUTES * 60)}",
        f"#PBS -l {size}",
        "#PBS -r n",
        "#PBS -j oe",
        f"#PBS -o {log}",
        *rescue_body(plan, f'"${{{RESCUE_FOR_VAR}:?which job this rescue watches}}"'),
    ]
    return RenderedJob(text="\n".join(lines) + "\n", filename=RESCUE_SCRIPT_NAME)


def _task_cmd(plan: JobPlan) -> str:
    """What pbsdsh starts on every node: the agent, after the setup lines when there are any (a
    pbsdsh task starts from the job's base environment, not from this script's)."""
    agent = plan.agent_argv()[:-1]
    if not plan.setup:
        return join(agent)
    return join(["/bin/bash", "-c", "; ".join([*plan.setup, 'exec "$@"']), "bash", *agent])


class PbsScheduler(BatchScheduler):
    kind = "pbs"
    commands = COMMANDS

    def render(self, plan: JobPlan) -> RenderedJob:
        return render_pbs(plan)

    def submit(self, plan: JobPlan, rendered: RenderedJob) -> str:
        script = Path(plan.run_dir) / rendered.filename
        return qsub([str(script)], cwd=Path(plan.run_dir) / "scheduler")

    def submit_held(self, plan: JobPlan, rendered: RenderedJob) -> str:
        # A user hold on the command line: the script (which continuations submit again) has none.
        script = Path(plan.run_dir) / rendered.filename
        return qsub(["-h", str(script)], cwd=Path(plan.run_dir) / "scheduler")

    def status(self, paths: RunPaths, job_id: str) -> SchedulerStatus:
        return pbs_status(job_id)

    def render_rescue(self, plan: JobPlan) -> RenderedJob:
        return render_rescue(plan)

    def hand_over_rescue(self, script: Path, paths: RunPaths, job_id: str) -> str:
        return qsub([*rescue_qsub_args(job_id), str(script)], cwd=paths.scheduler_dir)

    def continuation_held(self, plan: JobPlan, paths: RunPaths, avoid: list[str]) -> tuple[JobPlan, str]:
        """(rescue) The run as a new held job: PBS Pro names healthy hosts outside ``avoid`` (with as
        many hot spares as hosts are left for); Torque cannot, and runs the run's own script."""
        if plan.pbs_dialect == "pro":
            hosts = usable_hosts(sorted({*plan.exclude, *avoid}))
            spares = spares_that_fit(plan, None if hosts is None else len(hosts))
            plan = plan_avoiding(plan, paths, avoid, spare_nodes=spares)
        return plan, qsub(["-h", str(paths.root / SCRIPT_NAME)], cwd=paths.scheduler_dir)

    # ---- allocation side ------------------------------------------------------------------------

    # PBS Pro names the hosts a job may use (select ...:host=), so a continuation can avoid a node
    # by naming healthy ones instead; exclude_nodes says why where it cannot (Torque, too few nodes).
    can_exclude_nodes = True

    def node_context(self, plan: JobPlan, environ: Mapping[str, str], *, now: float) -> NodeContext:
        ctx = node_context_from_env(environ)
        # PBS states no end: the job script records its start (pbsdsh tasks are handed it).
        clock = plan.attempt_clock(start=float(environ.get(START_TIME_VAR) or now), scheduler_end=None)
        # PBS has no restart counter in the job's environment: attempts of earlier jobs of this run
        # come from the ledger, reruns of this very job (qrerun, preemption) from its run_count.
        earlier = {
            e.attempt for e in of_kind(read_events(plan.paths()).events, Started) if e.job_id != ctx.job_id
        }
        job = own_job(ctx.job_id)
        reruns = max(0, job.run_count - 1) if job is not None else 0
        return NodeContext(**{**ctx.__dict__, "restart_count": len(earlier) + reruns, "clock": clock})

    def node_address(self, host: str) -> str:
        return resolve_address(host)

    def termination_cause(self, paths: RunPaths, ctx: NodeContext, *, now: float) -> Cause:
        """qdel, qrerun, a preemption and the walltime all arrive as SIGTERM; PBS's record of the
        job tells them apart: qdel comments it "... terminated by USER@HOST" before the signal, a
        rerun shows as substate RERUN (PBS will run the job again)."""
        job = own_job(ctx.job_id)
        if job is not None and job.rerun_in_progress:
            return Cause.PREEMPTION
        if job is not None and " terminated by " in job.comment:
            return Cause.CANCELLED
        return Cause.TIMEOUT if at_time_limit(ctx, now) else Cause.PREEMPTION

    def continue_job(self, plan: JobPlan, paths: RunPaths, ctx: NodeContext) -> Continuation:
        """Come back after a stop: PBS reruns a job it is requeueing itself (qrerun, preemption);
        otherwise a continuation job runs this run's script once this job has ended."""
        job = own_job(ctx.job_id)
        if job is not None and job.rerun_in_progress:
            return Continuation(ctx.job_id, by="scheduler")
        job_id = submit_after(paths.root / SCRIPT_NAME, paths, ctx)
        leave_rescue(self, plan, paths, job_id, role="agent")
        return Continuation(job_id, held=ctx.array_task is not None)

    def exclude_nodes(
        self, plan: JobPlan, paths: RunPaths, ctx: NodeContext, nodes: list[str]
    ) -> Continuation:
        """A continuation that avoids ``nodes``. PBS Pro cannot say "not these": the new job names as
        many healthy hosts as it needs (``select=1:...:host=A+1:...:host=B``) and waits for those."""
        new_plan = plan_avoiding(plan, paths, nodes)
        job_id = submit_after(paths.root / SCRIPT_NAME, paths, ctx)
        leave_rescue(self, new_plan, paths, job_id, role="agent")
        return Continuation(job_id, held=ctx.array_task is not None)

    def kill_grace_s(self, plan: JobPlan) -> float:
        """The kill_delay of this job's queue (preflight names a queue whose delay is shorter than
        a save); PBS's default, 10 s, where the server does not say."""
        queue = plan.partition
        job = own_job(os.environ.get("PBS_JOBID", "")) if os.environ.get("PBS_JOBID") else None
        if job is not None and job.queue:
            queue = job.queue
        if queue:
            try:
                out = proc.run(["qstat", "-Q", "-f", "-F", "json", queue], timeout=20)
                found = pbs_json.parse_queues(out.stdout).get(queue) if out.returncode == 0 else None
                if found is not None and found.kill_delay_s is not None:
                    return float(found.kill_delay_s)
            except (OSError, subprocess.TimeoutExpired, ValueError):
                pass
        return float(pbs_json.DEFAULT_KILL_DELAY_S)


def plan_avoiding(
    plan: JobPlan, paths: RunPaths, nodes: list[str], *, spare_nodes: int | None = None
) -> JobPlan:
    """The run's plan and script rewritten to name healthy hosts outside ``nodes`` (PBS Pro cannot
    say "not these": the job names as many healthy hosts as it needs and waits for those).
    ``spare_nodes``: fewer hot spares than the run's (too few hosts are left for them)."""
    avoid = sorted({*plan.exclude, *nodes})
    if plan.pbs_dialect != "pro":
        raise SchedulerError(
            f"PBS ({plan.pbs_dialect} dialect) cannot keep a job off {', '.join(avoid)}: only PBS Pro's "
            "select names the hosts of a job",
            where="exclude",
            hint="drain or fix the node (pbsnodes -o), then hpclaunch submit --resume",
        )
    sized = plan.model_copy(update={"spare_nodes": spare_nodes}) if spare_nodes is not None else plan
    new_plan = sized.model_copy(update={"exclude": avoid, "hosts": pick_hosts(sized, avoid)})
    rendered = render_pbs(new_plan)
    write_plan(paths, new_plan)
    write_script(paths, rendered)
    return new_plan


def usable_hosts(avoid: list[str]) -> list[str] | None:
    """Hosts PBS could run a chunk on, outside ``avoid``; None when PBS cannot say."""
    try:
        nodes = pbs_json.parse_nodes(_run(["pbsnodes", "-a", "-F", "json"], what="pbsnodes"))
    except (SchedulerError, ValueError):
        return None
    return list(
        dict.fromkeys(
            n.host for n in nodes.values() if n.usable and n.host not in avoid and n.name not in avoid
        )
    )


def own_job(job_id: str) -> pbs_json.PbsJob | None:
    """PBS's record of a job (``qstat -f -F json``); None where PBS has no JSON (Torque, Slurm's
    emulation) or does not answer: callers then know only what the signal and the clock say."""
    try:
        out = proc.run(["qstat", "-f", "-F", "json", job_id], timeout=20)
        return pbs_json.find_job(pbs_json.parse_jobs(out.stdout), job_id) if out.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, ValueError):
        return None


def submit_after(script: Path, paths: RunPaths, ctx: NodeContext) -> str:
    """qsub ``script`` to run once this job has ended.

    PBS refuses a dependency on a sub-job of an array ("illegal -W value" for ``afterany:12[3]``),
    so a sweep point's continuation is submitted held (``Continuation.held``): the decider records
    its decision, hands the run's lock to it (it must not find this attempt still holding the run)
    and only then releases it. The hand-over is the decider's, under its epoch: made here, before
    the record, it would depose the decider that made it.
    """
    if ctx.array_task is None:
        return qsub(["-W", f"depend=afterany:{ctx.job_id}", str(script)], cwd=paths.scheduler_dir)
    return qsub(["-h", str(script)], cwd=paths.scheduler_dir)


def pick_hosts(plan: JobPlan, avoid: list[str]) -> list[str]:
    """``plan.allocation_nodes`` usable hosts outside ``avoid`` that can take one chunk, free ones first."""
    try:
        nodes = pbs_json.parse_nodes(_run(["pbsnodes", "-a", "-F", "json"], what="pbsnodes"))
    except ValueError as e:
        raise SchedulerError(f"cannot read PBS's nodes ({e})", where="pbsnodes") from None
    fit = [
        n
        for n in nodes.values()
        if n.usable
        and n.host not in avoid
        and n.name not in avoid
        and n.count("ncpus") >= plan.cpus_per_task
        and n.count("ngpus") >= plan.gpus_per_node
    ]
    fit.sort(key=lambda n: n.state != "free")
    hosts = list(dict.fromkeys(n.host for n in fit))
    if len(hosts) < plan.allocation_nodes:
        have = f"only {len(hosts)} ({', '.join(hosts)})" if hosts else "none"
        raise SchedulerError(
            f"PBS cannot keep this run off {', '.join(avoid)}: the job needs {plan.allocation_nodes} other usable "
            f"node(s) that can take a chunk, the server has {have}",
            where="exclude",
            hint="fix the node or bring others online, then hpclaunch submit --resume",
        )
    return hosts[: plan.allocation_nodes]


def qsub(args: list[str], *, cwd: Path) -> str:
    cwd.mkdir(parents=True, exist_ok=True)
    out = _run(["qsub", *args], what="qsub", cwd=cwd)
    job_id = out.strip().splitlines()[-1].strip() if out.strip() else ""
    if not re.fullmatch(r"\d+(\[\d*\])?(\.\S+)?", job_id):
        raise SchedulerError(f"qsub answered {out.strip()!r}, not a job id", where="qsub")
    return job_id


def pbs_status(job_id: str) -> SchedulerStatus:
    """``qstat -x -f -F json`` (finished jobs too; every state told apart, see ``pbs_json``); where
    PBS has no JSON (Torque, Slurm's emulation), the state letter of ``qstat -f``."""
    try:
        out = proc.run(["qstat", "-x", "-f", "-F", "json", job_id], timeout=30)
        if out.returncode == 0 and out.stdout.lstrip().startswith("{"):
            job = pbs_json.find_job(pbs_json.parse_jobs(out.stdout), job_id)
            if job is not None:
                return job.status()
        elif "Unknown Job Id" in out.stderr:
            return SchedulerStatus(JobState.UNKNOWN, "", "PBS no longer lists the job")
    except (FileNotFoundError, subprocess.TimeoutExpired, ValueError):
        pass
    try:
        out = proc.run(["qstat", "-f", job_id], timeout=30)
    except (FileNotFoundError, subprocess.TimeoutExpired) as e:
        return SchedulerStatus(JobState.UNKNOWN, "", f"cannot ask PBS: {e}", answered=False)
    m = re.search(r"job_state\s*=\s*(\w)", out.stdout)
    if out.returncode != 0 and "unknown job id" not in out.stderr.lower():
        # The server is down or unreachable: not "the job is gone".
        return SchedulerStatus(JobState.UNKNOWN, "", f"cannot ask PBS: {out.stderr.strip()}", answered=False)
    if out.returncode != 0 or not m:
        return SchedulerStatus(JobState.UNKNOWN, "", "PBS no longer lists the job")
    word = m.group(1).upper()
    return SchedulerStatus(STATE_MAP.get(word, JobState.UNKNOWN), word)


# ---- inside the job -----------------------------------------------------------------------------

_MPI_RANK_VARS = ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK", "PALS_RANKID", "MPI_RANK")


def node_context_from_env(environ: Mapping[str, str]) -> NodeContext:
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
                hint="launch one agent per node with mpiexec --ppn 1 or pbsdsh",
            )
    array = environ.get("PBS_ARRAY_INDEX") or environ.get("PBS_ARRAYID")
    return NodeContext(
        scheduler="pbs",
        job_id=environ["PBS_JOBID"],
        node_rank=node_rank,
        num_nodes=len(hosts),
        hostname=hosts[node_rank] if node_rank < len(hosts) else hostname,
        hosts=hosts,
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
