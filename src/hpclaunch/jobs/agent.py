"""The node agent: one per node, started by the scheduler (srun task, mpiexec/pbsdsh, local controller).

It owns everything between the scheduler and torchrun:
1. reads the plan and its NodeContext, records ``started`` in the ledger;
2. runs the node checks (a failing node ends the attempt; on SLURM the job requeues without it);
3. resolves the NCCL preset on this node and starts torchrun with USR1/USR2 (and, where torchrun
   lets us, TERM/INT) ignored, so a scheduler signal can never kill torchrun and orphan the workers;
4. relays the scheduler's warning / SIGTERM / Ctrl-C to the workers: the cause goes into the control
   file (authoritative) and a signal goes straight to the worker pids (the workers only set a flag);
5. after torchrun exits, node 0 reads the trainer's outcome and decides: finished, continue (requeue
   for timeout/preemption/user-continue within ``max_requeues``), retry a crash within
   ``max_failure_retries``, or fail. Causes stay distinct all the way to the ledger.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

from ..config import RunConfig, load_config
from ..errors import HpclaunchError
from ..orchestrator import runs
from ..orchestrator.plan import JobPlan
from ..orchestrator.runs import Ledger, RunPaths
from ..orchestrator.schedulers.base import LOCAL_REQUEUE_EXIT, get_scheduler
from . import env as job_env
from .stop import StopCause, read_stop_request, write_stop_request

CONTINUE_CAUSES = ("timeout", "preemption")
POLL_S = 0.2


@dataclass
class Outcome:
    """How the trainer ended (from RUN/attempts/<attempt>.json, or inferred when it is missing)."""

    status: str  # finished | stopped | failed
    cause: str | None = None
    step: int | None = None
    error: str | None = None

    @classmethod
    def read(cls, path: Path, returncode: int) -> Outcome:
        try:
            data = json.loads(path.read_text())
            return cls(data.get("status", "failed"), data.get("cause"), data.get("step"), data.get("error"))
        except (FileNotFoundError, json.JSONDecodeError):
            return cls(
                "failed", "crash", None, f"torchrun exited with {returncode} and the trainer left no outcome"
            )


class SignalInbox:
    """Signal handlers that only record what arrived; the agent's loop acts on it."""

    def __init__(self) -> None:
        self.received: list[int] = []

    def install(self) -> None:
        for sig in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGINT, signal.SIGCONT):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.received.append(signum)

    def take(self) -> list[int]:
        taken, self.received = self.received[:], []
        return taken


def _ignored_signals_preexec() -> None:
    """Runs in the child before exec: ignored dispositions survive exec (and reach the workers,
    which install their own handlers)."""
    for sig in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)


def torchrun_supports(flag: str) -> bool:
    """Whether the installed torchrun has ``flag`` (read from its source; importing torch is slow)."""
    import importlib.util

    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.origin:
        return False
    source = Path(spec.origin).parent / "distributed" / "run.py"
    try:
        return flag in source.read_text()
    except OSError:
        return False


class NodeAgent:
    def __init__(self, paths: RunPaths, plan: JobPlan, cfg: RunConfig, ctx: job_env.NodeContext):
        self.paths = paths
        self.plan = plan
        self.cfg = cfg
        self.ctx = ctx
        self.attempt = ctx.attempt
        self.ledger = Ledger(paths.events, attempt=self.attempt, node=ctx.node_rank)
        self.inbox = SignalInbox()
        self.proc: subprocess.Popen[bytes] | None = None
        self.stop_cause: StopCause = StopCause.NONE
        self.warned = False

    # ---- main ----------------------------------------------------------------------------------

    def run(self) -> int:
        self.inbox.install()
        self.ledger.append(
            runs.STARTED,
            scheduler=self.ctx.scheduler,
            job_id=self.ctx.job_id,
            restart_count=self.ctx.restart_count,
            nodes=self.ctx.num_nodes,
            hosts=list(self.ctx.hosts),
            world_size=self.plan.world_size,
            end_time=self.ctx.end_time,
        )
        if not self._node_checks_pass():
            return self._handle_node_failure()
        env = self._environment()
        argv = self._torchrun_argv()
        log_path = self.paths.node_log(self.attempt, self.ctx.node_rank)
        returncode = self._launch_and_wait(argv, env, log_path)
        if not self.ctx.is_head:
            return 0 if returncode == 0 else 1
        outcome = Outcome.read(self.paths.outcome_file(self.attempt), returncode)
        return self._decide(outcome, returncode)

    # ---- node checks -----------------------------------------------------------------------------

    def _node_checks_pass(self) -> bool:
        if not self.cfg.preflight.node_checks:
            return True
        from ..preflight import NODE_CHECKS, run_node_checks

        # The env probe (a job-Python import of torch) costs seconds per attempt and torchrun would
        # fail just as clearly; the other checks are cheap and find broken nodes before rendezvous.
        report = run_node_checks(self.cfg, self.ctx, only=set(NODE_CHECKS) - {"env"})
        failed = [c for c in report.checks if c.status == "fail"]
        self.ledger.append(
            runs.NODE_PREFLIGHT,
            ok=not failed,
            checks=[{"name": c.name, "status": c.status, "finding": c.finding} for c in report.checks],
        )
        if failed:
            self._failed_check = failed[0]
            print(
                f"hpclaunch: node {self.ctx.hostname} failed check {failed[0].name}: {failed[0].finding}",
                file=sys.stderr,
                flush=True,
            )
        return not failed

    def _handle_node_failure(self) -> int:
        check = getattr(self, "_failed_check", None)
        reason = f"node {self.ctx.hostname} failed check {check.name if check else '?'}"
        if self.ctx.scheduler == "slurm":
            excluded = [e for e in self.ledger.events() if e.get("event") == runs.NODE_EXCLUDED]
            if len(excluded) < self.cfg.preflight.max_node_excludes:
                from ..orchestrator.schedulers.slurm import resubmit_excluding

                nodes = sorted({*self.plan.exclude, *(e["excluded"] for e in excluded), self.ctx.hostname})
                self.ledger.append(
                    runs.NODE_EXCLUDED, excluded=self.ctx.hostname, exclude=nodes, reason=reason
                )
                new_id = resubmit_excluding(self.plan, self.paths, nodes)
                self.ledger.append(
                    runs.REQUEUED, cause="node_failure", by="agent", job_id=new_id, exclude=nodes
                )
                return 0
        self.ledger.append(runs.FAILED, cause="node_failure", error=reason)
        return 1

    # ---- launch ----------------------------------------------------------------------------------

    def _environment(self) -> dict[str, str]:
        env = dict(os.environ)
        # The batch script exports these too, but launchers such as pbsdsh start agents with a
        # minimal environment: the plan is the source of truth.
        env.update(self.plan.env)
        env.update(self._nccl_env())
        if self.ctx.num_nodes > 1 and "GLOO_SOCKET_IFNAME" not in env:
            # gloo advertises the address its hostname resolves to, which may be loopback or a
            # network the other nodes cannot reach; pin it to the interface of our own address.
            iface = job_env.interface_of(job_env.node_address(self.ctx, self.ctx.hostname))
            if iface:
                env["GLOO_SOCKET_IFNAME"] = iface
        env[job_env.ATTEMPT_VAR] = self.attempt
        env[job_env.RUN_DIR_VAR] = str(self.paths.root)
        if self.ctx.end_time is not None:
            env[job_env.END_TIME_VAR] = f"{self.ctx.end_time:.3f}"
        # The agent relays stop requests; submitit's variables must not leak into the trainer.
        env.pop("SUBMITIT_EXECUTOR", None)
        return env

    def _nccl_env(self) -> dict[str, str]:
        if self.plan.backend != "nccl":
            return {}
        from .nccl import nccl_environment

        resolved = nccl_environment(self.cfg.nccl)
        self.ledger.append("nccl_preset", preset=resolved.name, reason=resolved.reason, env=resolved.env)
        return dict(resolved.env)

    def _torchrun_argv(self) -> list[str]:
        head_addr = local_addr = None
        if self.ctx.num_nodes > 1:
            head_addr = job_env.rendezvous_address(self.ctx)
            local_addr = job_env.node_address(self.ctx, self.ctx.hostname)
        argv = self.plan.torchrun_argv(
            run_dir=str(self.paths.root),
            node_rank=self.ctx.node_rank,
            job_id=self.ctx.job_id,
            head_addr=head_addr,
            local_addr=local_addr,
        )
        extra = []
        if torchrun_supports("--signals-to-handle"):
            # torchrun would otherwise catch TERM/INT, kill the workers 30 s later and exit non-zero.
            extra.append("--signals-to-handle=SIGHUP,SIGQUIT")
        if torchrun_supports("--shutdown-timeout"):
            extra.append(f"--shutdown-timeout={self.plan.torchrun.shutdown_timeout_s}")
        i = argv.index("--module")
        return argv[:i] + extra + argv[i:]

    def _launch_and_wait(self, argv: list[str], env: dict[str, str], log_path: Path) -> int:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            header = f"# hpclaunch attempt {self.attempt} node {self.ctx.node_rank} ({self.ctx.hostname}): {' '.join(argv)}\n"
            log.write(header.encode())
            log.flush()
            self.proc = subprocess.Popen(
                argv,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                preexec_fn=_ignored_signals_preexec,
                cwd=str(self.paths.root),
            )
            pump = threading.Thread(target=_tee, args=(self.proc.stdout, log, sys.stdout), daemon=True)
            pump.start()
            while self.proc.poll() is None:
                self._handle_signals()
                time.sleep(POLL_S)
            self._handle_signals()
            pump.join(timeout=5)
        return self.proc.returncode

    # ---- stop relay ------------------------------------------------------------------------------

    def _handle_signals(self) -> None:
        for signum in self.inbox.take():
            if signum == signal.SIGCONT:
                continue  # SLURM sends CONT before TERM/USR*; nothing to do
            cause, relay = self._classify(signum)
            if cause == StopCause.NONE:
                continue
            first = self.stop_cause == StopCause.NONE
            self.stop_cause = max(self.stop_cause, cause)
            if self.ctx.is_head or read_stop_request(self.paths.stop_file) == StopCause.NONE:
                write_stop_request(
                    self.paths.stop_file, self.stop_cause, by=f"agent:{signal.Signals(signum).name}"
                )
            if first or signum == signal.SIGTERM:
                self.ledger.append(
                    runs.STOP_REQUESTED, cause=self.stop_cause.label, source=signal.Signals(signum).name
                )
            self._signal_workers(relay)
            if signum == signal.SIGINT and not first:
                self._escalate()

    def _classify(self, signum: int) -> tuple[StopCause, int]:
        if signum in (signal.SIGUSR1, signal.SIGUSR2):
            self.warned = True
            return StopCause.TIMEOUT, signal.SIGUSR1
        if signum == signal.SIGINT:
            return StopCause.USER, signal.SIGINT
        if signum == signal.SIGTERM:
            # At the time limit (after the warning, or past the end) TERM is the timeout itself;
            # otherwise the scheduler is taking the nodes away: preemption.
            end = self.ctx.end_time
            near_end = end is not None and time.time() >= end - self.plan.warn_lead_s
            if self.warned or near_end:
                return StopCause.TIMEOUT, signal.SIGUSR1
            return StopCause.PREEMPTION, signal.SIGTERM
        return StopCause.NONE, 0

    def _worker_pids(self) -> list[int]:
        if self.proc is None:
            return []
        import psutil

        try:
            # Only torchrun's direct children are trainer ranks; deeper processes keep default handlers.
            return [p.pid for p in psutil.Process(self.proc.pid).children(recursive=False)]
        except psutil.NoSuchProcess:
            return []

    def _signal_workers(self, signum: int) -> None:
        for pid in self._worker_pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    def _escalate(self) -> None:
        """Second Ctrl-C: stop waiting for the save; torchrun shuts the workers down."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGHUP)

    # ---- decision (node 0) -----------------------------------------------------------------------

    def _decide(self, outcome: Outcome, returncode: int) -> int:
        if outcome.status == "finished":
            self._consume_stop_request()
            self.ledger.append(runs.FINISHED, step=outcome.step)
            return 0
        if outcome.status == "stopped":
            cause = self._refine_cause(outcome.cause or "user")
            self._consume_stop_request()
            if cause == "cancelled":
                self.ledger.append(runs.CANCELLED, step=outcome.step, by="scheduler")
                return 0
            wants_continue = cause in CONTINUE_CAUSES or (
                cause == "user" and self.paths.continue_file.exists()
            )
            if cause == "user" and self.paths.continue_file.exists():
                self.paths.continue_file.unlink(missing_ok=True)
            if not wants_continue:
                return 0  # a user stop: `hpclaunch submit --resume RUN` continues it later
            return self._continue(
                cause, budget=self.plan.max_requeues, counted=("timeout", "preemption", "user")
            )
        error = outcome.error or f"exit code {returncode}"
        if outcome.cause != "crash":
            # The trainer itself decided to fail (non-finite steps, incompatible checkpoint): the same
            # code on the same data would fail again, so this is never retried.
            self.ledger.append(runs.FAILED, cause="training", error=error, retry=False)
            return 1
        # A crash (Python error, NCCL failure, killed worker) has its own small retry budget.
        return self._continue("crash", budget=self.plan.max_failure_retries, counted=("crash",), error=error)

    def _refine_cause(self, cause: str) -> str:
        """A SIGTERM may have been a cancellation (scancel, `hpclaunch cancel`): never requeue that."""
        if self.stop_cause == StopCause.NONE and cause == "user":
            return cause  # a `hpclaunch stop` through the control file, no signal involved
        if any(e.get("event") == runs.CANCELLED for e in self._events_since_start()):
            return "cancelled"
        return get_scheduler(self.ctx.scheduler).termination_cause(self.paths, self.ctx, cause) or cause

    def _events_since_start(self) -> list[dict[str, Any]]:
        events = self.ledger.events()
        starts = [
            i
            for i, e in enumerate(events)
            if e.get("event") == runs.STARTED and e.get("attempt") == self.attempt
        ]
        return events[starts[0] :] if starts else events

    def _continue(
        self, cause: str, *, budget: int, counted: tuple[str, ...], error: str | None = None
    ) -> int:
        used = sum(
            1 for e in self.ledger.events() if e.get("event") == runs.REQUEUED and e.get("cause") in counted
        )
        if used >= budget:
            what = "requeues" if cause != "crash" else "failure retries"
            self.ledger.append(
                runs.FAILED,
                cause=cause,
                error=(error + "; " if error else "") + f"{used} {what} used of {budget}",
                retry=False,
            )
            return 1
        if cause == "preemption" and self.ctx.scheduler == "slurm":
            # SLURM requeues a preempted job itself (scontrol requeue / PreemptMode=REQUEUE).
            self.ledger.append(runs.REQUEUED, cause=cause, by="scheduler", error=error)
            return 0
        if self.ctx.scheduler == "local":
            self.ledger.append(runs.REQUEUED, cause=cause, by="agent", error=error)
            return LOCAL_REQUEUE_EXIT
        new_id = get_scheduler(self.ctx.scheduler).continue_job(self.plan, self.paths, self.ctx)
        self.ledger.append(runs.REQUEUED, cause=cause, by="agent", job_id=new_id, error=error)
        return 0

    def _consume_stop_request(self) -> None:
        """A stop request applies to the attempt that saw it; the next attempt starts clean."""
        stop = self.paths.stop_file
        if stop.exists():
            stop.rename(stop.with_name(f"stop.handled.{self.attempt}"))


def _tee(source: Any, log: Any, echo: TextIO) -> None:
    for line in iter(source.readline, b""):
        log.write(line)
        log.flush()
        try:
            echo.buffer.write(line)
            echo.flush()
        except (AttributeError, ValueError, OSError):
            pass


def agent_main(run_dir: str) -> int:
    """The node agent's entry point (the submitit callable; also ``python -m hpclaunch.jobs.agent``)."""
    paths = RunPaths(Path(run_dir))
    plan = JobPlan.model_validate_json(paths.plan.read_text())
    cfg = load_config(paths.config)
    paths = RunPaths(Path(run_dir), Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else None)
    try:
        ctx = job_env.node_context(kind=plan.scheduler, time_limit_s=plan.time_limit_s)
        if ctx.scheduler == "slurm":
            # SLURM's EndTime is authoritative (it restarts with every requeue).
            from ..orchestrator.schedulers.slurm import job_end_time

            end = job_end_time(ctx.job_id)
            if end is not None:
                ctx = dataclasses.replace(ctx, end_time=end)
        elif ctx.scheduler == "pbs":
            # PBS has no restart counter; each continuation is a new job, counted in the ledger.
            earlier = {
                e.get("job_id") for e in Ledger(paths.events).events() if e.get("event") == runs.STARTED
            }
            ctx = dataclasses.replace(ctx, restart_count=len(earlier - {ctx.job_id}))
        code = NodeAgent(paths, plan, cfg, ctx).run()
    except HpclaunchError as e:
        Ledger(paths.events).append(runs.FAILED, cause="crash", error=e.one_line(), retry=False)
        print(f"hpclaunch: agent error: {e.one_line()}", file=sys.stderr, flush=True)
        code = 1
    if code != 0 and os.environ.get("SUBMITIT_EXECUTOR"):
        sys.exit(code)  # submitit would exit 0 after pickling the return value; SLURM must see the code
    return code


def main() -> None:
    if len(sys.argv) != 2:
        print("usage: python -m hpclaunch.jobs.agent RUN_DIR", file=sys.stderr)
        sys.exit(2)
    sys.exit(agent_main(sys.argv[1]))


if __name__ == "__main__":
    main()
