"""The embedded local scheduler: the default, for a workstation or laptop with no cluster.

It keeps SLURM's contract on one machine, so the whole stop -> save -> requeue -> resume cycle runs
here for real: a detached controller process runs the rendered ``job.local.sh`` once per attempt,
sends SIGUSR2 to every process of the job ``warn_lead_s`` before the time limit, SIGTERM at the
limit and SIGKILL ``kill_wait_s`` later (as SLURM signals every process of a job step: the agent,
its rank host, the ranks and their DataLoader workers all receive it); when the agent exits with
``LOCAL_REQUEUE_EXIT`` it starts the next attempt with the restart count increased.

Why not submitit's LocalExecutor: it caps restarts at 6 whatever ``max_requeues`` says, its
job id is the pid of a process that pickles our callable, and it kills at the limit without a
kill wait. The contract (warning signal, requeue exit code, restart counter) is the same.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import SchedulerError
from ..fsutil import atomic_write_json
from ..rundir import Heartbeat, JobPlan, RunLock, RunPaths, read_plan
from ..rundir.cause import Cause
from ..rundir.env import JOB_ID_VAR, RESTART_VAR, START_TIME_VAR
from ..templates import jinja
from . import foreground, local_slots
from .nodes import resolve_address
from .protocol import (
    LOCAL_REQUEUE_EXIT,
    Continuation,
    JobState,
    NodeContext,
    RenderedJob,
    SchedulerStatus,
    at_time_limit,
    env_int,
)

SCRIPT_NAME = "job.local.sh"
STATE_FILE = "local.json"
HOLD_FILE = "hold"  # present: the controller waits before its first attempt (a chain's next stage)


def render_local(plan: JobPlan) -> RenderedJob:
    text = jinja.render_job("local.sh.j2", plan, run_dir=plan.run_dir)
    return RenderedJob(text=text, filename=SCRIPT_NAME)


class LocalScheduler:
    kind = "local"

    def render(self, plan: JobPlan) -> RenderedJob:
        return render_local(plan)

    def submit_held(self, plan: JobPlan, rendered: RenderedJob) -> str:
        """``submit`` with the hold file in place: the controller waits until ``release`` removes it."""
        sched = Path(plan.run_dir) / "scheduler"
        sched.mkdir(parents=True, exist_ok=True)
        (sched / HOLD_FILE).write_text("held until the run before this one finishes\n")
        return self.submit(plan, rendered)

    def release(self, paths: RunPaths, job_id: str) -> None:
        (paths.scheduler_dir / HOLD_FILE).unlink(missing_ok=True)

    def submit(self, plan: JobPlan, rendered: RenderedJob) -> str:
        """Start the controller detached (it outlives this command) and return its job id."""
        root = Path(plan.run_dir)
        sched = root / "scheduler"
        sched.mkdir(parents=True, exist_ok=True)
        log = open(sched / "controller.log", "ab")  # noqa: SIM115 (handed to the child)
        proc = subprocess.Popen(
            [sys.executable, "-m", __name__, str(root)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # Ctrl-C in the submitting shell must not reach the job
            cwd=str(root),
        )
        log.close()
        job_id = f"local{proc.pid}"
        # The controller writes its state file at start; wait for it so `status` right after works.
        deadline = time.time() + 30
        while time.time() < deadline:
            state = read_state(sched)
            if state.get("job_id") == job_id:
                return job_id
            if proc.poll() is not None:
                raise SchedulerError(
                    f"the local controller exited at once (code {proc.returncode})",
                    where=str(sched / "controller.log"),
                )
            time.sleep(0.05)
        raise SchedulerError(
            "the local controller did not start within 30 s", where=str(sched / "controller.log")
        )

    def status(self, paths: RunPaths, job_id: str) -> SchedulerStatus:
        if foreground.is_foreground(job_id):  # a `hpclaunch train`: no controller, the lock says
            return foreground.status(paths, job_id)
        state = read_state(paths.scheduler_dir)
        if state.get("job_id") != job_id:
            return SchedulerStatus(JobState.UNKNOWN, "", "no local controller state for this job")
        word = str(state.get("state", "unknown"))
        if word == "running" and not _alive(int(state.get("pid", 0))):
            return SchedulerStatus(JobState.FAILED, "lost", "the controller died without recording an end")
        return SchedulerStatus(_STATES.get(word, JobState.UNKNOWN), word, str(state.get("reason", "")))

    def cancel(self, paths: RunPaths, job_id: str) -> None:
        if foreground.is_foreground(job_id):
            foreground.cancel(paths, job_id)
            return
        state = read_state(paths.scheduler_dir)
        pid = int(state.get("pid", 0))
        if state.get("job_id") != job_id or not _alive(pid):
            raise SchedulerError(f"local job {job_id} is not running", where="cancel")
        os.kill(pid, signal.SIGTERM)

    # ---- allocation side ----------------------------------------------------------------------

    can_exclude_nodes = False

    def node_context(self, plan: JobPlan, environ: Mapping[str, str], *, now: float) -> NodeContext:
        hostname = socket.gethostname().split(".")[0]
        return NodeContext(
            scheduler="local",
            job_id=environ.get(JOB_ID_VAR) or foreground.job_id(),
            node_rank=0,
            num_nodes=1,
            hostname=hostname,
            hosts=(hostname,),
            restart_count=env_int(environ, RESTART_VAR, 0),
            # The controller states the attempt's start; a foreground `train` has no limit.
            clock=plan.attempt_clock(start=float(environ[START_TIME_VAR]), scheduler_end=None)
            if environ.get(START_TIME_VAR)
            else None,
        )

    def node_address(self, host: str) -> str:
        return resolve_address(host)

    def termination_cause(self, paths: RunPaths, ctx: NodeContext, *, now: float) -> Cause:
        # The controller records "cancelling" before it signals a cancellation (like scancel).
        if read_state(paths.scheduler_dir).get("state") == "cancelling":
            return Cause.CANCELLED
        return Cause.TIMEOUT if at_time_limit(ctx, now) else Cause.PREEMPTION

    def continue_job(self, plan: JobPlan, paths: RunPaths, ctx: NodeContext) -> Continuation:
        # The agent asks by exiting with LOCAL_REQUEUE_EXIT; the controller restarts the attempt.
        return Continuation(ctx.job_id, exit_code=LOCAL_REQUEUE_EXIT)

    def exclude_nodes(
        self, plan: JobPlan, paths: RunPaths, ctx: NodeContext, nodes: list[str]
    ) -> Continuation:
        raise SchedulerError("the local scheduler runs on one machine; it cannot exclude nodes")

    def withdraw(self, paths: RunPaths, ctx: NodeContext) -> str:
        return "nothing to withdraw: the local controller ends with this attempt"

    def kill_grace_s(self, plan: JobPlan) -> float:
        return float(plan.kill_wait_s)


_STATES = {
    "held": JobState.HELD,
    "running": JobState.RUNNING,
    "cancelling": JobState.RUNNING,
    "requeued": JobState.REQUEUED,
    "completed": JobState.COMPLETED,
    "failed": JobState.FAILED,
    "timeout": JobState.TIMEOUT,
    "cancelled": JobState.CANCELLED,
}


def read_state(sched_dir: Path) -> dict[str, Any]:
    try:
        data = json.loads((sched_dir / STATE_FILE).read_text())
        return data if isinstance(data, dict) else {}
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


# ---- the controller (runs detached: python -m hpclaunch.schedulers.local RUN_DIR) ----


class Controller:
    def __init__(self, run_dir: Path, *, clock: Any = time.time):
        self.root = run_dir
        self.paths = RunPaths(run_dir)
        self.sched = self.paths.scheduler_dir
        self.plan = read_plan(self.paths)
        self.lock = RunLock(self.paths)
        self.job_id = f"local{os.getpid()}"
        self.clock = clock
        self.cancelled = False
        self.proc: subprocess.Popen[bytes] | None = None

    def _state(self, state: str, **extra: Any) -> None:
        atomic_write_json(
            self.sched / STATE_FILE,
            {"job_id": self.job_id, "pid": os.getpid(), "state": state, "updated": time.time(), **extra},
        )

    def _on_cancel(self, signum: int, frame: Any) -> None:
        self.cancelled = True

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_cancel)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        restart = 0
        # The controller is the job: it holds the run directory across its attempts.
        holder = self.lock.adopt(job_id=self.job_id, role="controller")
        try:
            if not self._released():
                self._state("cancelled", restart_count=restart, reason="cancelled while held")
                return 0
            self._state("running", restart_count=restart)
            with Heartbeat(self.lock, holder):  # alive, as another host sharing the run dir sees it
                while True:
                    code, how = self._attempt(restart)
                    if self.cancelled:
                        self._state("cancelled", restart_count=restart, exit_code=code)
                        return 0
                    if code == LOCAL_REQUEUE_EXIT:
                        restart += 1
                        self._state("running", restart_count=restart, reason="requeued")
                        continue
                    final = "completed" if code == 0 else ("timeout" if how == "timeout" else "failed")
                    self._state(final, restart_count=restart, exit_code=code)
                    return code
        finally:
            self.lock.release(holder)

    def _released(self) -> bool:
        """Wait while the hold file exists (``release`` removes it), then for a slot among the
        sweep's points (``local_slots``); False when cancelled first."""
        hold = self.sched / HOLD_FILE
        if hold.exists():
            self._state("held", reason="held until the run before this one finishes")
        while hold.exists():
            if self.cancelled:
                return False
            time.sleep(0.5)
        parallelism = self.plan.array_parallelism
        waiting = False
        while parallelism and not local_slots.may_start(
            self.root, parallelism, lambda p: read_state(RunPaths(p).scheduler_dir), _alive
        ):
            if not waiting:
                reason = f"waiting for a slot: scheduler.array_parallelism is {parallelism}"
                self._state("held", reason=reason, slot=True)
                waiting = True
            if self.cancelled:
                return False
            time.sleep(0.5)
        return not self.cancelled

    def _attempt(self, restart: int) -> tuple[int, str]:
        start = self.clock()
        end = self.plan.attempt_clock(start=start, scheduler_end=None).end
        env = dict(os.environ)
        env.update({JOB_ID_VAR: self.job_id, RESTART_VAR: str(restart), START_TIME_VAR: f"{start:.3f}"})
        out = open(self.sched / f"{self.job_id}.out", "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(
            ["bash", str(self.root / SCRIPT_NAME)],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        out.close()
        warned = terminated = False
        how = "exit"
        while self.proc.poll() is None:
            now = self.clock()
            if self.cancelled and not terminated:
                # Like scancel: TERM now, KILL after the kill wait. The state file says why, so
                # the agent does not mistake it for a preemption and ask for another attempt.
                self._state("cancelling", restart_count=restart)
                self._signal_job(signal.SIGTERM)
                terminated, end = True, now
            if not warned and not terminated and now >= end - self.plan.warn_lead_s:
                self._signal_job(signal.SIGUSR2)
                warned = True
            if not terminated and now >= end:
                self._signal_job(signal.SIGTERM)
                terminated, how = True, "timeout"
            if terminated and now >= end + self.plan.kill_wait_s:
                self._kill_tree()
                how = "timeout" if not self.cancelled else "cancelled"
            time.sleep(0.1)
        return self.proc.returncode, how

    def _signal_job(self, signum: int) -> None:
        # Like SLURM (a time limit, scancel, scontrol requeue, --signal without B:): every process of
        # the job gets the signal, not only the launched task. The agent relays the cause; everything
        # else under it (the rank host, ranks in their own sessions, DataLoader workers) must survive it.
        for p in self._job_processes():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(p, signum)

    def _kill_tree(self) -> None:
        for p in self._job_processes():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(p, signal.SIGKILL)

    def _job_processes(self) -> list[int]:
        import psutil

        if self.proc is None:
            return []
        try:
            parent = psutil.Process(self.proc.pid)
            return [parent.pid, *(c.pid for c in parent.children(recursive=True))]
        except psutil.NoSuchProcess:
            return []


def main() -> None:
    if len(sys.argv) != 2:
        print("usage: python -m hpclaunch.schedulers.local RUN_DIR", file=sys.stderr)
        sys.exit(2)
    sys.exit(Controller(Path(sys.argv[1])).run())


if __name__ == "__main__":
    main()
