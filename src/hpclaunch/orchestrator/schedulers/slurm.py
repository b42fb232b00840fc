"""SLURM: the script is submitit's sbatch file (one task per node running the node agent).

``render`` builds the text with submitit's own formatter from the plan; ``submit`` hands exactly
that text to ``sbatch --parsable`` through a ``SlurmExecutor`` subclass, which pickles the node agent
as the job's callable. Status comes from ``squeue --json`` (then ``sacct --json`` when accounting
exists), mapped to ``JobState`` without collapsing PREEMPTED/TIMEOUT/NODE_FAIL into FAILED.
"""

from __future__ import annotations

import json
import subprocess
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...errors import SchedulerError
from ...templates import lint
from ...templates.shell import Raw, directive_value, export_line, quote
from .base import JobState, RenderedJob, SchedulerStatus, run_command

if TYPE_CHECKING:
    from ...jobs.env import NodeContext
    from ..plan import JobPlan
    from ..runs import RunPaths

SUBMITIT_DIR = "scheduler/submitit"

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


def submitit_command(plan: JobPlan, folder: Path) -> str:
    """The command line submitit puts after ``srun`` (its own format: python -u -m ... folder)."""
    return " ".join([quote(plan.python), "-u -m submitit.core._submit", quote(str(folder))])


def _setup_lines(plan: JobPlan) -> list[str]:
    lines: list[str] = [Raw(line) for line in plan.setup]
    # Slurm >= 22.05: srun no longer inherits --cpus-per-task from sbatch.
    lines.append(Raw('export SRUN_CPUS_PER_TASK="$SLURM_CPUS_PER_TASK"'))
    lines += [export_line(name, value) for name, value in sorted(plan.env.items())]
    if plan.pass_env:
        lines.append(
            "# passed from the submitting environment by name (values are never written here): "
            + " ".join(plan.pass_env)
        )
    return lines


def _sbatch_parameters(plan: JobPlan) -> dict[str, Any]:
    for path in (plan.run_dir,):
        directive_value(path, what="run_dir")
    params: dict[str, Any] = {
        "job_name": plan.name,
        "time": plan.time_limit_minutes,
        "nodes": plan.nodes,
        "ntasks_per_node": 1,
        "cpus_per_task": plan.cpus_per_task,
        "signal_delay_s": plan.warn_lead_s,
        "stderr_to_stdout": True,
        "wckey": None,
        "setup": _setup_lines(plan),
        # Explicit --requeue: some sites set JobRequeue=0; hpclaunch decides per cause whether to requeue.
        "additional_parameters": {"requeue": True},
        # One broken node must end the step instead of leaving the others waiting in rendezvous.
        "srun_args": ["--kill-on-bad-exit=1"],
    }
    if plan.gpus_per_node:
        params["gpus_per_node"] = plan.gpus_per_node
    if plan.mem_gb:
        gb = plan.mem_gb
        params["mem"] = f"{int(gb)}GB" if gb == int(gb) else f"{int(gb * 1024)}MB"
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
    from submitit.slurm.slurm import _make_sbatch_string

    folder = submitit_folder(plan.run_dir)
    text = _make_sbatch_string(
        command=submitit_command(plan, folder), folder=folder, **_sbatch_parameters(plan)
    )
    lines = text.split("\n")
    last = max(i for i, line in enumerate(lines) if line.startswith("#SBATCH"))
    extra = [_extra_directive(d) for d in plan.extra_directives]
    lines[last + 1 : last + 1] = extra
    text = "\n".join(lines)
    findings = lint.lint_slurm(
        text,
        generated_lines=last + 1,
        time_limit_s=plan.time_limit_s,
        stop_lead_s=plan.stop_lead_s,
        warn_lead_s=plan.warn_lead_s,
    )
    warnings = lint.enforce(findings, script_name="job.sbatch")
    return RenderedJob(text=text, filename="job.sbatch", warnings=[w.message for w in warnings])


def _extra_directive(line: str) -> str:
    line = line.strip()
    if not line.startswith("#SBATCH "):
        from ...errors import ScriptLintError

        raise ScriptLintError(
            f"extra directive {line!r} does not start with '#SBATCH '",
            where="scheduler.extra_directives",
            hint="give whole lines, e.g. '#SBATCH --mail-type=END'",
        )
    return line


def _hpclaunch_executor(plan: JobPlan, rendered: RenderedJob) -> Any:
    """A SlurmExecutor whose submission file is exactly ``rendered.text``."""
    import submitit
    from submitit.core import utils
    from submitit.slurm.slurm import SlurmJob

    folder = submitit_folder(plan.run_dir)
    expected_command = submitit_command(plan, folder)

    class HpclaunchSlurmExecutor(submitit.SlurmExecutor):
        def _make_submission_file_text(self, command: str, uid: str) -> str:
            if command != expected_command:  # render and submit must not drift apart
                raise SchedulerError(f"submitit command {command!r} differs from the rendered one")
            return rendered.text

        def _make_submission_command(self, submission_file_path: Path) -> list[str]:
            return ["sbatch", "--parsable", str(submission_file_path)]

        @staticmethod
        def _get_job_id_from_submission_command(string: bytes | str) -> str:
            text = string.decode() if isinstance(string, bytes) else string
            job_id = text.strip().split(";")[0]
            if not job_id.isdigit():
                raise SchedulerError(f"sbatch answered {text.strip()!r}, not a job id")
            return job_id

        def _internal_process_submissions(self, delayed_submissions: list[Any]) -> list[Any]:
            if len(delayed_submissions) == 1:
                return super()._internal_process_submissions(delayed_submissions)
            # submitit submits arrays through a fresh plain SlurmExecutor, which would render its own
            # script; this is its array path with ``self`` kept so the rendered text is what is sent.
            pickles = []
            for delayed in delayed_submissions:
                path = utils.JobPaths.get_first_id_independent_folder(self.folder) / f"{uuid.uuid4().hex}.pkl"
                path.parent.mkdir(parents=True, exist_ok=True)
                delayed.set_timeout(plan.time_limit_minutes, self.max_num_timeout)
                delayed.dump(path)
                pickles.append(path)
            first = self._submit_command(self._submitit_command_str)
            jobs: list[Any] = [
                SlurmJob(folder=self.folder, job_id=f"{first.job_id}_{i}", tasks=list(range(first.num_tasks)))
                for i in range(len(delayed_submissions))
            ]
            for job, path in zip(jobs, pickles, strict=True):
                job.paths.move_temporary_file(path, "submitted_pickle")
            return jobs

    try:
        executor = HpclaunchSlurmExecutor(folder=folder, python=quote(plan.python))
    except RuntimeError as e:  # submitit: no srun on PATH
        raise SchedulerError(
            str(e), where="submit", hint="run on a SLURM login node, or use scheduler.kind: local"
        ) from None
    executor.parameters.update({"nodes": plan.nodes, "ntasks_per_node": 1, "time": plan.time_limit_minutes})
    return executor


class SlurmScheduler:
    kind = "slurm"

    def render(self, plan: JobPlan) -> RenderedJob:
        return render_sbatch(plan)

    def submit(self, plan: JobPlan, rendered: RenderedJob) -> str:
        from ...jobs.agent import agent_main

        executor = _hpclaunch_executor(plan, rendered)
        try:
            if plan.sweep:
                jobs = executor.map_array(agent_main, [p.run_dir for p in plan.sweep])
                return str(jobs[0].job_id).split("_")[0]
            return str(executor.submit(agent_main, plan.run_dir).job_id)
        except subprocess.CalledProcessError as e:
            raise SchedulerError(
                f"sbatch failed: {(e.stderr or e.output or b'')!r}", where="submit"
            ) from None
        except Exception as e:  # submitit wraps sbatch errors in FailedJobError
            if type(e).__name__ in ("FailedJobError", "FailedSubmissionError"):
                first = str(e).strip().splitlines()
                raise SchedulerError(f"sbatch failed: {first[-1] if first else e}", where="submit") from None
            raise

    def status(self, paths: RunPaths, job_id: str) -> SchedulerStatus:
        return slurm_status(job_id)

    def cancel(self, paths: RunPaths, job_id: str) -> None:
        _run(["scancel", job_id], what="scancel")

    def termination_cause(self, paths: RunPaths, ctx: NodeContext, cause: str) -> str | None:
        # After a warning, a SIGTERM is the time limit itself; only an unannounced one is ambiguous.
        return termination_cause(ctx.job_id, ctx.restart_count) if cause == "preemption" else None

    def continue_job(self, plan: JobPlan, paths: RunPaths, ctx: NodeContext) -> str:
        """Requeue this very job (same id; SLURM_RESTART_COUNT grows). Arrays requeue their task."""
        _run(["scontrol", "requeue", ctx.job_id], what="scontrol requeue")
        return ctx.job_id


def _run(argv: list[str], *, what: str, cwd: Path | None = None, timeout: float = 60) -> str:
    return run_command(argv, what=what, hint="is SLURM installed on this host?", cwd=cwd, timeout=timeout)


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
    out = subprocess.run(["sacct", "--json", "-j", job_id], capture_output=True, text=True, timeout=30)
    return parse_sacct_json(out.stdout, job_id) if out.returncode == 0 else None


def slurm_status(job_id: str) -> SchedulerStatus:
    """squeue first (live, and it keeps finished jobs for MinJobAge), then accounting."""
    try:
        out = subprocess.run(
            ["squeue", "--json", "--jobs", job_id], capture_output=True, text=True, timeout=30
        )
        if out.returncode == 0:
            found = parse_squeue_json(out.stdout, job_id)
            if found is not None:
                return found
        return sacct_status(job_id) or SchedulerStatus(
            JobState.UNKNOWN, "", "SLURM no longer lists the job (no accounting)"
        )
    except (FileNotFoundError, subprocess.TimeoutExpired, json.JSONDecodeError) as e:
        return SchedulerStatus(JobState.UNKNOWN, "", f"cannot ask SLURM: {e}")


def show_job(job_id: str) -> dict[str, str]:
    """``scontrol show job -o`` as a dict (empty when SLURM does not know the job)."""
    try:
        out = subprocess.run(
            ["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=30
        )
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


def job_end_time(job_id: str) -> float | None:
    """The job's EndTime as a time.time() value (None when unknown or unlimited)."""
    import datetime as _dt

    end = show_job(job_id).get("EndTime", "")
    try:
        return _dt.datetime.strptime(end, "%Y-%m-%dT%H:%M:%S").timestamp()
    except ValueError:
        return None


def termination_cause(job_id: str, restart_count: int) -> str | None:
    """'cancelled' when a SIGTERM (without a prior warning) came from scancel; None for a requeue.

    Both show JobState=COMPLETING while the job's processes are killed (measured on Slurm 22.05),
    but a requeue has already raised ``Restarts`` past this attempt's restart count.
    """
    job = show_job(job_id)
    if not job:
        return None
    if int(job.get("Restarts", "0") or 0) > restart_count:
        return None
    state = job.get("JobState", "")
    return "cancelled" if state.startswith(("CANCELLED", "COMPLETING")) else None


def resubmit_excluding(plan: JobPlan, paths: RunPaths, nodes: list[str]) -> str:
    """Submit this run again as a new job that never lands on ``nodes``; returns its job id.

    Not ``scontrol requeuehold`` + ``update ExcNodeList`` + ``release``: a requeued job stays
    COMPLETING until all of its processes have exited, and the update and the release both fail
    before that (measured on Slurm 22.05), so the job cannot do it for itself.
    """
    from submitit.helpers import clean_env

    from ...fsutil import atomic_write_json, atomic_write_text

    new_plan = plan.model_copy(update={"exclude": sorted(set(plan.exclude) | set(nodes))})
    rendered = render_sbatch(new_plan)
    atomic_write_json(paths.plan, new_plan.model_dump(mode="json"))
    atomic_write_text(paths.root / rendered.filename, rendered.text, mode=0o755)
    with clean_env():  # sbatch inside a job would inherit this job's SLURM_* settings
        return SlurmScheduler().submit(new_plan, rendered)
