"""SLURM: the script is submitit's sbatch file running one node agent per node under ``srun``.

``render`` builds the text with submitit's formatter (``submitit_adapter``) from the plan, with
the node agent's own command line (``python -u -m hpclaunch.jobs.agent RUN``), so the script shows
what runs on every node; ``submit`` hands exactly that file to ``sbatch --parsable``. A sweep is one
array whose tasks each run the agent on the sweep's root; the agent picks its point by
``SLURM_ARRAY_TASK_ID``. Status comes from ``squeue --json``, then ``sacct --json`` when accounting
exists, then submitit's ``sacct --parsable2`` watcher (Slurm without JSON output), mapped to
``JobState`` without collapsing PREEMPTED/TIMEOUT/NODE_FAIL into FAILED.

Inside the job: node lists come from ``scontrol show hostnames`` (never parsed by hand), the end
of the attempt from ``scontrol show job`` (EndTime restarts with every requeue), and a SIGTERM is
told apart by the job's own record: at the end time it is the time limit, with ``Restarts`` already
raised it is a requeue (preemption, ``scontrol requeue``), otherwise a cancellation.
"""

from __future__ import annotations

import datetime as _dt
import json
import socket
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .. import proc
from ..errors import SchedulerError
from ..rundir import JobPlan, RunPaths, read_plan
from ..rundir.cause import Cause
from ..rundir.plan import write_plan
from ..templates import lint
from ..templates.container_lines import container_lines
from ..templates.exports import job_exports, script_header
from ..templates.shell import Raw, directive_value, join, slurm_filename
from . import submitit_adapter
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

SUBMITIT_DIR = "scheduler/submitit"
SCRIPT_NAME = "job.sbatch"
RESCUE_SCRIPT_NAME = "rescue.sbatch"
COMMANDS = BatchCommands(
    release=("scontrol", "release"),
    cancel=("scancel",),
    cancelled="cancelled",
    hint="is SLURM installed on this host?",
)
_run = COMMANDS.run  # every command this module runs (its failure a SchedulerError with the hint)

# squeue/sacct state words -> ours. Anything unknown stays UNKNOWN with the raw word shown.
STATE_MAP: dict[str, JobState] = {
    "PENDING": JobState.PENDING,
    "CONFIGURING": JobState.PENDING,
    "SUSPENDED": JobState.PENDING,
    "RUNNING": JobState.RUNNING,
    "COMPLETING": JobState.RUNNING,
    "SIGNALING": JobState.RUNNING,
    "STAGE_OUT": JobState.RUNNING,
    "RESIZING": JobState.RUNNING,
    "REQUEUED": JobState.REQUEUED,
    "REQUEUE_FED": JobState.REQUEUED,
    "REQUEUE_HOLD": JobState.REQUEUED,
    "PREEMPTED": JobState.PREEMPTED,
    "TIMEOUT": JobState.TIMEOUT,
    "DEADLINE": JobState.TIMEOUT,
    "NODE_FAIL": JobState.NODE_FAIL,
    "BOOT_FAIL": JobState.NODE_FAIL,
    "FAILED": JobState.FAILED,
    "OUT_OF_MEMORY": JobState.FAILED,
    "COMPLETED": JobState.COMPLETED,
    "CANCELLED": JobState.CANCELLED,
}


def submitit_folder(run_dir: str) -> Path:
    return Path(run_dir) / SUBMITIT_DIR


def agent_command(plan: JobPlan) -> str:
    """The command ``srun`` starts on every node: the node agent on this run directory."""
    return join(plan.agent_argv())


def _setup_lines(plan: JobPlan) -> list[str]:
    lines: list[str] = [Raw(line) for line in plan.setup]
    # Slurm >= 22.05: srun no longer inherits --cpus-per-task from sbatch. A whole node (--exclusive,
    # no --cpus-per-task): the agent's task gets every CPU of its node.
    cpus = "SLURM_CPUS_ON_NODE" if plan.whole_node else "SLURM_CPUS_PER_TASK"
    lines.append(Raw(f'export SRUN_CPUS_PER_TASK="${cpus}"'))
    lines += job_exports(plan)
    if plan.pass_env:
        lines.append(
            "# passed from the submitting environment by name (values are never written here): "
            + " ".join(plan.pass_env)
        )
    lines += container_lines(plan)
    return lines


def _sbatch_parameters(plan: JobPlan) -> dict[str, Any]:
    directive_value(plan.run_dir, what="run_dir")
    params: dict[str, Any] = {
        "job_name": plan.name,
        "time": plan.time_limit_minutes,
        "nodes": plan.allocation_nodes,
        "ntasks_per_node": 1,
        "signal_delay_s": plan.warn_lead_s,
        "stderr_to_stdout": True,
        "wckey": None,
        "setup": _setup_lines(plan),
        # Explicit --requeue: some sites set JobRequeue=0; hpclaunch decides per cause whether to requeue.
        # --no-kill: a node that fails must not end the job; the agents of the others recover in place.
        "additional_parameters": {"requeue": True, "no_kill": True},
        # A node whose agent died must not take the other agents with it: they decide (node 0, or
        # the first live agent when node 0 is the one gone) and continue in place or requeue.
        "srun_args": ["--kill-on-bad-exit=0"],
    }
    if plan.whole_node:
        params["exclusive"] = True
    else:
        params["cpus_per_task"] = plan.cpus_per_task
    if plan.gpus_per_node:
        params["gpus_per_node"] = plan.gpus_per_node
    mem = mem_directive(plan.mem_gb, lower=False)
    if mem:
        params["mem"] = mem
    for key in ("partition", "account", "qos", "constraint"):
        value = getattr(plan, key)
        if value:
            params[key] = value
    if plan.exclude:
        params["exclude"] = ",".join(plan.exclude)
    if plan.sweep:
        params["map_count"] = len(plan.sweep)
        params["array_parallelism"] = plan.array_parallelism or len(plan.sweep)
    return params


def render_sbatch(plan: JobPlan) -> RenderedJob:
    text = submitit_adapter.sbatch_text(
        command=agent_command(plan), folder=submitit_folder(plan.run_dir), **_sbatch_parameters(plan)
    )
    lines = text.split("\n")
    lines[1:1] = [script_header(plan)]
    last = max(i for i, line in enumerate(lines) if line.startswith("#SBATCH"))
    lines[last + 1 : last + 1] = lint.extra_directives(plan.extra_directives, "#SBATCH")
    text = "\n".join(lines)
    findings = lint.lint_slurm(
        text,
        generated_lines=last + 1,
        plan=plan,
    )
    warnings = lint.enforce(findings, script_name=SCRIPT_NAME)
    return RenderedJob(text=text, filename=SCRIPT_NAME, warnings=[w.message for w in warnings])


def rescue_sbatch_args(job_id: str) -> list[str]:
    """How a rescue is handed over: held until ``job_id`` ends in a failed state, dropped by SLURM
    when it ends well, and told which job it watches (the script's ``$1``)."""
    return [f"--dependency=afternotok:{job_id}", "--kill-on-invalid-dep=yes"]


def render_rescue(plan: JobPlan) -> RenderedJob:
    """The rescue job's script (``schedulers.rescue_job``): one task, a few minutes, the run's account,
    ``scheduler.rescue``'s partition, QOS and GPUs; its output beside the submitit folder."""
    name = directive_value(f"{plan.name}-rescue", what="name")
    # a file-name pattern: the run directory's own '%'s doubled, %j the rescue's job id
    log = directive_value(
        slurm_filename(str(Path(plan.run_dir) / "scheduler")) + "/rescue-%j.out", what="run_dir"
    )
    submitted = f"sbatch --parsable {' '.join(rescue_sbatch_args('JOB'))} {RESCUE_SCRIPT_NAME} JOB"
    lines = [
        *rescue_header(plan, submitted),
        f"#SBATCH --job-name={name}",
        "#SBATCH --nodes=1",
        "#SBATCH --ntasks=1",
        "#SBATCH --cpus-per-task=1",
        f"#SBATCH --time={RESCUE_MINUTES}",
        f"#SBATCH --output={log}",
        "#SBATCH --open-mode=append",
        "#SBATCH --no-requeue",
    ]
    r = plan.rescue
    for key, value in (("partition", r.partition), ("account", plan.account), ("qos", r.qos)):
        if value:
            lines.append(f"#SBATCH --{key}={directive_value(value, what=f'scheduler.{key}')}")
    if r.gpus:
        lines.append(f"#SBATCH --gpus-per-node={r.gpus}")
    lines += rescue_body(plan, '"$1"')
    return RenderedJob(text="\n".join(lines) + "\n", filename=RESCUE_SCRIPT_NAME)


def sbatch(
    script: Path,
    *,
    cwd: Path,
    hold: bool = False,
    extra: list[str] | None = None,
    args: list[str] | None = None,
) -> str:
    """Submit ``script`` as it is; the job id (``sbatch --parsable`` prints ``id[;cluster]``).
    ``hold``, ``extra``: on the command line, never in the script, which continuations submit
    again; ``args``: the script's own arguments."""
    argv = ["sbatch", "--parsable", *(["--hold"] if hold else []), *(extra or []), str(script), *(args or [])]
    out = _run(argv, what="sbatch", cwd=cwd)
    job_id = out.strip().split(";")[0]
    if not job_id.isdigit():
        raise SchedulerError(f"sbatch answered {out.strip()!r}, not a job id", where="sbatch")
    return job_id


class SlurmScheduler(BatchScheduler):
    kind = "slurm"
    commands = COMMANDS
    can_exclude_nodes = True

    # ---- login side -----------------------------------------------------------------------------

    def render(self, plan: JobPlan) -> RenderedJob:
        return render_sbatch(plan)

    def submit(self, plan: JobPlan, rendered: RenderedJob, *, hold: bool = False) -> str:
        folder = submitit_folder(plan.run_dir)
        folder.mkdir(parents=True, exist_ok=True)
        script = Path(plan.run_dir) / rendered.filename
        if script.read_text() != rendered.text:  # render and submit must not drift apart
            raise SchedulerError(f"{script} differs from the rendered script", where="submit")
        return sbatch(script, cwd=folder, hold=hold)

    def submit_held(self, plan: JobPlan, rendered: RenderedJob) -> str:
        return self.submit(plan, rendered, hold=True)

    def status(self, paths: RunPaths, job_id: str) -> SchedulerStatus:
        return slurm_status(job_id)

    def render_rescue(self, plan: JobPlan) -> RenderedJob:
        return render_rescue(plan)

    def hand_over_rescue(self, script: Path, paths: RunPaths, job_id: str) -> str:
        paths.scheduler_dir.mkdir(parents=True, exist_ok=True)
        with submitit_adapter.clean_env():  # from inside a job: not this job's SLURM_* settings
            return sbatch(script, cwd=paths.scheduler_dir, extra=[*rescue_sbatch_args(job_id)], args=[job_id])

    def continuation_held(self, plan: JobPlan, paths: RunPaths, avoid: list[str]) -> tuple[JobPlan, str]:
        """(rescue) The run as a new held job that never lands on ``avoid``, with as many of its hot
        spares as the partition still has nodes for; ``release`` starts it."""
        job_id = resubmit_excluding(plan, paths, avoid, hold=True, spare_nodes=spares_left(plan, avoid))
        return read_plan(paths), job_id

    # ---- allocation side ------------------------------------------------------------------------

    def node_context(self, plan: JobPlan, environ: Mapping[str, str], *, now: float) -> NodeContext:
        ctx = node_context_from_env(environ, hostnames=scontrol_hostnames)
        # EndTime restarts with every requeue; SLURM applies the limit in whole minutes.
        clock = plan.attempt_clock(
            start=float(environ.get("SLURM_JOB_START_TIME") or now),
            scheduler_end=job_end_time(ctx.job_id) or _env_end_time(environ),
            limit_s=plan.applied_time_limit_s,
        )
        return NodeContext(**{**ctx.__dict__, "clock": clock})

    def node_address(self, host: str) -> str:
        """SLURM's NodeAddr (what slurmd listens on), else DNS."""
        addr = slurm_node_addr(host)
        return resolve_address(addr or host)

    def termination_cause(self, paths: RunPaths, ctx: NodeContext, *, now: float) -> Cause:
        if at_time_limit(ctx, now):
            return Cause.TIMEOUT
        job = show_job(ctx.job_id)
        if not job:
            return Cause.PREEMPTION  # SLURM cannot be asked: save, and let the decision sort it out
        if int(job.get("Restarts", "0") or 0) > ctx.restart_count:
            return Cause.PREEMPTION  # a requeue (preemption, scontrol requeue) raised Restarts first
        if batch_host_died(job):
            # Nobody cancelled it: its batch script died (node 0 emptied, or dead) and SLURM ends
            # the job. The agents left save and decide (node 0's death); if SLURM kills them first,
            # the job's rescue does (``schedulers.rescue_job``).
            return Cause.PREEMPTION
        return Cause.CANCELLED

    def continue_job(self, plan: JobPlan, paths: RunPaths, ctx: NodeContext) -> Continuation:
        """Requeue this very job (same id; SLURM_RESTART_COUNT grows). Arrays requeue their task."""
        if int(show_job(ctx.job_id).get("Restarts", "0") or 0) > ctx.restart_count:
            return Continuation(ctx.job_id, by="scheduler")  # SLURM is requeueing it already
        _run(["scontrol", "requeue", ctx.job_id], what="scontrol requeue")
        return Continuation(ctx.job_id)

    def exclude_nodes(
        self, plan: JobPlan, paths: RunPaths, ctx: NodeContext, nodes: list[str]
    ) -> Continuation:
        job_id = resubmit_excluding(plan, paths, nodes, spare_nodes=spares_left(plan, nodes))
        leave_rescue(self, plan, paths, job_id, role="agent")
        return Continuation(job_id)

    def kill_grace_s(self, plan: JobPlan) -> float:
        return float(kill_wait_s())


# ---- inside the job -----------------------------------------------------------------------------


def batch_host_died(job: Mapping[str, str]) -> bool:
    """The job ends because its batch script was killed (``scontrol show job``: ExitCode 0:9,
    Reason=JobLaunchFailure; measured on Slurm 22.05 with every job process on the batch host
    SIGKILLed), not because someone cancelled it (ExitCode 0:0 or 0:15, Reason=None)."""
    return job.get("Reason") == "JobLaunchFailure" or job.get("ExitCode", "").endswith(":9")


def scontrol_hostnames(nodelist: str) -> list[str]:
    """``scontrol show hostnames`` of a SLURM node list (``rack[1-2]-n[01-02]`` and all its forms)."""
    if not nodelist:
        return []
    try:
        out = proc.run(["scontrol", "show", "hostnames", nodelist], timeout=30)
    except (FileNotFoundError, subprocess.TimeoutExpired) as e:
        raise NodeContextError(f"cannot expand SLURM_JOB_NODELIST={nodelist!r}: {e}") from None
    hosts = [line.strip() for line in out.stdout.splitlines() if line.strip()]
    if out.returncode != 0 or not hosts:
        # Slurm 22.05 prints "Invalid hostlist" and still exits 0.
        why = out.stderr.strip() or f"scontrol exited {out.returncode}"
        raise NodeContextError(f"cannot expand SLURM_JOB_NODELIST={nodelist!r}: {why}")
    return hosts


def _env_end_time(environ: Mapping[str, str]) -> float | None:
    value = environ.get("SLURM_JOB_END_TIME")
    return float(value) if value else None


def node_context_from_env(environ: Mapping[str, str], *, hostnames: Any = scontrol_hostnames) -> NodeContext:
    """This node of the job, from SLURM's variables (``hostnames`` expands the node list)."""
    if "SLURM_JOB_ID" not in environ:
        raise NodeContextError("SLURM_JOB_ID is not set", hint="is this running inside a SLURM job?")
    array_task = environ.get("SLURM_ARRAY_TASK_ID")
    job_id = environ["SLURM_JOB_ID"]
    if array_task and environ.get("SLURM_ARRAY_JOB_ID"):
        job_id = f"{environ['SLURM_ARRAY_JOB_ID']}_{array_task}"
    hosts = tuple(hostnames(environ.get("SLURM_JOB_NODELIST", "")))
    num_nodes = env_int(environ, "SLURM_JOB_NUM_NODES", len(hosts) or 1)
    hostname = environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]
    if not hosts:
        hosts = (hostname,)
    if len(hosts) != num_nodes:
        raise NodeContextError(
            f"SLURM_JOB_NODELIST names {len(hosts)} nodes but SLURM_JOB_NUM_NODES={num_nodes}"
        )
    return NodeContext(
        scheduler="slurm",
        job_id=job_id,
        node_rank=env_int(environ, "SLURM_NODEID", 0 if num_nodes == 1 else None),
        num_nodes=num_nodes,
        hostname=hostname,
        hosts=hosts,
        restart_count=env_int(environ, "SLURM_RESTART_COUNT", 0),
        array_task=int(array_task) if array_task else None,
    )


def slurm_node_addr(node: str, *, timeout: float = 10.0) -> str | None:
    """``NodeAddr`` of a SLURM node from ``scontrol show node -o`` (None when scontrol is absent)."""
    import re

    try:
        out = proc.run(["scontrol", "show", "node", "-o", node], timeout=timeout)
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"\bNodeAddr=(\S+)", out.stdout)
    return m.group(1) if m else None


def _state_word(value: Any) -> str:
    # Slurm 22.05 gives a string; newer releases give a list of flags (first = base state).
    if isinstance(value, list):
        return str(value[0]) if value else ""
    if isinstance(value, dict):  # sacct --json: {"current": ...}
        return _state_word(value.get("current"))
    return str(value or "")


def _number(value: Any) -> str:
    # Slurm 22.05 gives plain numbers; newer releases {"set": bool, "number": n}.
    if isinstance(value, dict):
        return str(value.get("number")) if value.get("set", True) else ""
    return "" if value is None else str(value)


def parse_squeue_json(text: str, job_id: str) -> SchedulerStatus | None:
    data = json.loads(text)
    array_id, _, task = job_id.partition("_")
    for job in data.get("jobs", []):
        if task:
            match = _number(job.get("array_job_id")) == array_id and _number(job.get("array_task_id")) == task
        else:
            match = _number(job.get("job_id")) == job_id
        if match:
            word = _state_word(job.get("job_state")).upper()
            return SchedulerStatus(
                STATE_MAP.get(word, JobState.UNKNOWN), word, str(job.get("state_reason") or "")
            )
    return None


def parse_sacct_json(text: str, job_id: str) -> SchedulerStatus | None:
    """The job's latest record in ``sacct --json`` (a requeued job has one record per run)."""
    data = json.loads(text)
    array_id, _, task = job_id.partition("_")
    records = []
    for job in data.get("jobs", []):
        array = job.get("array") or {}
        if task:
            match = _number(array.get("job_id")) == array_id and _number(array.get("task_id")) == task
        else:
            match = _number(job.get("job_id")) == job_id
        if match:
            records.append(job)
    if not records:
        return None

    def started(i: int) -> tuple[int, int]:
        times = records[i].get("time") or {}
        value = _number(times.get("start")) or _number(times.get("submission"))
        return (int(value) if value.isdigit() else 0, i)

    latest = records[max(range(len(records)), key=started)]
    state = latest.get("state")
    word = _state_word(state).upper()
    reason = str(state.get("reason") or "") if isinstance(state, dict) else ""
    notes = [reason] if reason not in ("", "None") else []
    requeues = sum(1 for r in records if _state_word(r.get("state")).upper() == "REQUEUED")
    if requeues:
        notes.append(f"requeued {requeues}x (sacct)")
    return SchedulerStatus(STATE_MAP.get(word, JobState.UNKNOWN), word, "; ".join(notes))


def sacct_status(job_id: str) -> SchedulerStatus | None:
    """From accounting; None when there is none (no slurmdbd) or it does not know the job."""
    out = proc.run(["sacct", "--json", "-j", job_id], timeout=30)
    return parse_sacct_json(out.stdout, job_id) if out.returncode == 0 else None


def slurm_status(job_id: str) -> SchedulerStatus:
    """squeue first (live, and it keeps finished jobs for MinJobAge), then accounting."""
    try:
        out = proc.run(["squeue", "--json", "--jobs", job_id], timeout=30)
        if out.returncode == 0:
            found = parse_squeue_json(out.stdout, job_id)
            if found is not None:
                return found
        found = sacct_status(job_id)
        if found is not None:
            return found
        if out.returncode != 0 and "json" in (out.stderr or "").lower():
            # A Slurm without JSON output (before 20.11): submitit's sacct --parsable2 watcher.
            word = submitit_adapter.sacct_state(job_id)
            if word:
                return SchedulerStatus(STATE_MAP.get(word, JobState.UNKNOWN), word, "sacct --parsable2")
        said = (out.stderr or "").strip()
        if out.returncode != 0 and "invalid job id" not in said.lower():
            # slurmctld down or unreachable: not "the job is gone"; the caller must not act on it.
            return SchedulerStatus(JobState.UNKNOWN, "", f"cannot ask SLURM: {said}", answered=False)
        return SchedulerStatus(JobState.UNKNOWN, "", "SLURM no longer lists the job (no accounting)")
    except (FileNotFoundError, subprocess.TimeoutExpired, json.JSONDecodeError) as e:
        return SchedulerStatus(JobState.UNKNOWN, "", f"cannot ask SLURM: {e}", answered=False)


def show_job(job_id: str) -> dict[str, str]:
    """``scontrol show job -o`` as a dict (empty when SLURM does not know the job)."""
    try:
        out = proc.run(["scontrol", "show", "job", "-o", job_id], timeout=30)
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return {}
    if out.returncode != 0:
        return {}
    fields: dict[str, str] = {}
    for token in out.stdout.split():
        key, eq, value = token.partition("=")
        if eq and key not in fields:
            fields[key] = value
    return fields


def kill_wait_s(default: int = 30) -> int:
    """``KillWait`` from ``scontrol show config`` (the seconds from SIGTERM to SIGKILL); 30 if unknown."""
    try:
        out = proc.run(["scontrol", "show", "config"], timeout=30)
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return default
    for line in out.stdout.splitlines():
        key, _, value = line.partition("=")
        if key.strip() == "KillWait":
            digits = value.strip().split()[0] if value.strip() else ""
            return int(digits) if digits.isdigit() else default
    return default


def job_end_time(job_id: str) -> float | None:
    """The job's EndTime as a time.time() value (None when unknown or unlimited)."""
    end = show_job(job_id).get("EndTime", "")
    try:
        return _dt.datetime.strptime(end, "%Y-%m-%dT%H:%M:%S").timestamp()
    except ValueError:
        return None


def resubmit_excluding(
    plan: JobPlan, paths: RunPaths, nodes: list[str], *, hold: bool = False, spare_nodes: int | None = None
) -> str:
    """Submit this run again as a new job that never lands on ``nodes``; returns its job id.
    ``hold``: it waits for ``release`` (the rescue hands the run's lock to it first);
    ``spare_nodes``: fewer hot spares than the run's (too few nodes are left for them).

    Not ``scontrol requeuehold`` + ``update ExcNodeList`` + ``release``: a requeued job stays
    COMPLETING until all of its processes have exited, and the update and the release both fail
    before that (measured on Slurm 22.05), so the job cannot do it for itself.
    """
    update: dict[str, Any] = {"exclude": sorted(set(plan.exclude) | set(nodes))}
    if spare_nodes is not None:
        update["spare_nodes"] = spare_nodes
    new_plan = plan.model_copy(update=update)
    rendered = render_sbatch(new_plan)
    write_plan(paths, new_plan)
    write_script(paths, rendered)
    with submitit_adapter.clean_env():  # sbatch inside a job would inherit this job's SLURM_* settings
        return SlurmScheduler().submit(new_plan, rendered, hold=hold)


def spares_left(plan: JobPlan, avoid: list[str]) -> int:
    """The hot spares a job avoiding ``avoid`` can still get, from the partition's nodes left to it
    (``base.spares_that_fit``)."""
    nodes = partition_nodes(plan.partition)
    usable = None if nodes is None else len([n for n in nodes if n not in {*plan.exclude, *avoid}])
    return spares_that_fit(plan, usable)


def partition_nodes(partition: str | None) -> list[str] | None:
    """The nodes of ``partition`` (the default one when None) that are not down or drained; None when
    SLURM cannot say."""
    argv = ["sinfo", "-h", "-N", "-o", "%N %P %t"]
    try:
        out = proc.run(argv, timeout=30)
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    nodes: list[str] = []
    for line in out.stdout.splitlines():
        parts = line.split()
        if len(parts) != 3:
            continue
        node, part, state = parts
        wanted = part.rstrip("*") == partition if partition else part.endswith("*")
        if wanted and not state.rstrip("*~#!%$@^-").startswith(("down", "drain", "fail")):
            nodes.append(node)
    return list(dict.fromkeys(nodes))
