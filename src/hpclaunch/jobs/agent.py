"""The node agent: one per node, started by the scheduler (srun task, mpiexec/pbsdsh, local controller).

It owns everything between the scheduler and torchrun:
1. reads the plan and its NodeContext (from the scheduler module), records ``started``;
2. node 0 first asks whether this attempt may run at all (``decide_start``: a run that had already
   ended is withdrawn) and takes the run-directory lock (a second writer is refused);
3. runs the node checks; on several nodes node 0 gathers every node's verdict before anyone starts
   torchrun (``node_checks.StartBarrier``);
4. starts torchrun with USR1/USR2/TERM/INT ignored (so a scheduler signal can never kill torchrun and
   orphan the workers) and relays the scheduler's warning / SIGTERM / Ctrl-C to the workers
   (``jobs.stop_relay``: the cause into the control file, a signal straight to the worker pids, a
   stop save cut short before the scheduler's kill); its watchdog (``jobs.watchdog``) watches the
   ranks' progress meanwhile and stops a hung attempt;
5. afterwards node 0 gathers the facts and calls ``decide``, then carries the decision out through
   the scheduler Protocol. Other nodes report and exit.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, BinaryIO

from ..config import RunConfig
from ..errors import HpclaunchError
from ..rundir import (
    CANCELLED,
    HANG,
    NCCL_PRESET,
    NODE_EXCLUDED,
    NODE_PREFLIGHT,
    REFUSED,
    STARTED,
    Heartbeat,
    JobPlan,
    Ledger,
    LockHolder,
    RunLock,
    RunPaths,
    holder_alive,
    read_config,
    read_outcome,
    read_plan,
)
from ..rundir.env import ATTEMPT_VAR, END_TIME_VAR, JOIN_STDERR_VAR, NODE_NAME_VAR, RUN_DIR_VAR
from ..schedulers.base import NodeContext, Scheduler, get_scheduler
from ..schedulers.nodes import interface_of, rendezvous_address
from .chain import after_attempt
from .decide import Action, Budgets, Decision, Facts, History, decide, decide_start
from .node_checks import NodeVerdict, StartBarrier, Verdicts, run_checks
from .stop import StopCause, read_stop_request
from .stop_relay import StopRelay, ignored_signals_preexec
from .watchdog import Verdict, Watchdog, flight_recorder_env, startup_hang

POLL_S = 0.2
FOREGROUND_VAR = (
    "HPCLAUNCH_FOREGROUND"  # set by `hpclaunch train`: keep torchrun's own report off the terminal
)


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
    def __init__(
        self, paths: RunPaths, plan: JobPlan, cfg: RunConfig, ctx: NodeContext, scheduler: Scheduler
    ):
        self.paths = paths
        self.plan = plan
        self.cfg = cfg
        self.ctx = ctx
        self.scheduler = scheduler
        self.attempt = ctx.attempt
        self.ledger = Ledger(paths, role="agent", attempt=self.attempt, node=ctx.node_rank)
        self.lock = RunLock(paths)
        self.holder: LockHolder | None = None
        self.relay = StopRelay(paths, plan, ctx, scheduler, self.ledger)
        self.proc: subprocess.Popen[bytes] | None = None
        self.hang: Verdict | None = None  # the watchdog's verdict on this attempt

    # ---- main ----------------------------------------------------------------------------------

    def run(self) -> int:
        self.relay.install()
        self.ledger.append(
            STARTED,
            scheduler=self.ctx.scheduler,
            job_id=self.ctx.job_id,
            restart_count=self.ctx.restart_count,
            nodes=self.ctx.num_nodes,
            hosts=list(self.ctx.hosts),
            world_size=self.plan.world_size,
            end_time=self.ctx.end_time,
        )
        barrier = StartBarrier(self.paths, self.attempt)
        if self.ctx.is_head:
            refusal = self._may_run()
            if refusal is not None:
                if self.ctx.num_nodes > 1:
                    barrier.announce(go=False, reason=refusal)
                return 0
        verdict = self._node_checks()
        if self.ctx.num_nodes > 1:
            barrier.report(verdict)
            if not self.ctx.is_head:
                go, reason = barrier.wait_go(timeout_s=3600)
                if not go:
                    print(f"hpclaunch: node {self.ctx.hostname} does not start: {reason}", file=sys.stderr)
                    return 0
            else:
                verdicts = barrier.gather(self.ctx)
                barrier.announce(go=verdicts.ok, reason="" if verdicts.ok else "a node failed its checks")
                if not verdicts.ok:
                    return self._carry_out(self._decide_after_checks(verdicts))
        elif not verdict.ok:
            return self._carry_out(self._decide_after_checks(Verdicts([verdict])))
        returncode = self._launch(self._torchrun_argv(), self._environment())
        if not self.ctx.is_head:
            return 0 if returncode == 0 else 1
        return self._carry_out(self._decide(returncode))

    # ---- may this attempt run? (node 0) ------------------------------------------------------------

    def _may_run(self) -> str | None:
        """None, or why this attempt does not run (recorded; the run is left untouched)."""
        events = self.ledger.events()
        withdraw = decide_start(History.from_events(events))
        if withdraw is not None:
            done = self.scheduler.withdraw(self.paths, self.ctx)
            self._record(withdraw, note=done)
            return withdraw.reason
        holder = self.lock.read()
        # "" is a submission that has not learned its job id yet: this job, just started.
        ours = holder is None or holder.job_id in ("", self.ctx.job_id)
        if holder is not None and not ours and holder_alive(holder, is_active=self._active):
            reason = f"the run directory is held by {holder.describe()}; this attempt does not touch it"
            self.ledger.append(REFUSED, reason=reason, holder=holder.job_id)
            print(f"hpclaunch: {reason}", file=sys.stderr, flush=True)
            return reason
        if holder is not None and holder.job_id == self.ctx.job_id and holder.role in ("controller", "train"):
            return None  # the local controller / the foreground command holds it for this job
        self.holder = self.lock.adopt(job_id=self.ctx.job_id, role="agent")
        return None

    def _active(self, holder: LockHolder) -> bool:
        try:
            return get_scheduler(holder.scheduler).status(self.paths, holder.job_id).state.active
        except (HpclaunchError, ValueError):
            return True  # cannot ask: assume the other writer is alive

    # ---- node checks ---------------------------------------------------------------------------

    def _node_checks(self) -> NodeVerdict:
        verdict, rows = run_checks(self.cfg, self.ctx)
        if rows:
            self.ledger.append(NODE_PREFLIGHT, ok=verdict.ok, checks=rows)
        return verdict

    def _decide_after_checks(self, verdicts: Verdicts) -> Decision:
        facts = Facts(
            outcome=None,
            failed_nodes=tuple(verdicts.failed_nodes),
            node_problems=verdicts.failed_nodes,
            data_error=verdicts.data_error,
        )
        return self._decision(facts)

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
            iface = interface_of(self.scheduler.node_address(self.ctx.hostname))
            if iface:
                env["GLOO_SOCKET_IFNAME"] = iface
        env[ATTEMPT_VAR] = self.attempt
        env[RUN_DIR_VAR] = str(self.paths.root)
        env[JOIN_STDERR_VAR] = "1"
        env[NODE_NAME_VAR] = self.ctx.hostname  # ranks report their node as the scheduler names it
        if self.ctx.end_time is not None:
            env[END_TIME_VAR] = f"{self.ctx.end_time:.3f}"
        env.pop("SUBMITIT_EXECUTOR", None)
        return env

    def _nccl_env(self) -> dict[str, str]:
        if self.plan.backend != "nccl":
            return {}
        from ..nccl import nccl_environment

        resolved = nccl_environment(self.cfg.nccl)
        env = dict(resolved.env)
        if self.cfg.nccl.preset != "none":  # the flight recorder, for the watchdog's evidence
            env = {**flight_recorder_env(self.paths, self.attempt), **env}
        self.ledger.append(NCCL_PRESET, preset=resolved.name, reason=resolved.reason, env=env)
        return env

    def _torchrun_argv(self) -> list[str]:
        head_addr = local_addr = None
        if self.ctx.num_nodes > 1:
            head_addr = rendezvous_address(self.ctx, self.scheduler)
            local_addr = self.scheduler.node_address(self.ctx.hostname)
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

    def _launch(self, argv: list[str], env: dict[str, str]) -> int:
        """torchrun until it exits. Workers' output (their stderr joins stdout) goes to the log and
        the terminal; torchrun's own stderr (its failure report) to the log, and to the terminal
        only when this is not a foreground ``hpclaunch train``."""
        log_path = self.paths.node_log(self.attempt, self.ctx.node_rank)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        beat = Heartbeat(self.lock, self.holder) if self.holder is not None else contextlib.nullcontext()
        with open(log_path, "ab") as log, beat:
            header = f"# hpclaunch attempt {self.attempt} node {self.ctx.node_rank} ({self.ctx.hostname}): {' '.join(argv)}\n"
            log.write(header.encode())
            log.flush()
            self.proc = subprocess.Popen(
                argv,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                preexec_fn=ignored_signals_preexec,
                cwd=str(self.paths.root),
            )
            lock = threading.Lock()
            quiet = os.environ.get(FOREGROUND_VAR) == "1"
            pumps = [
                threading.Thread(target=_tee, args=(self.proc.stdout, log, lock, True), daemon=True),
                threading.Thread(target=_tee, args=(self.proc.stderr, log, lock, not quiet), daemon=True),
            ]
            for pump in pumps:
                pump.start()
            watchdog = self._watchdog()
            self.relay.proc = self.proc
            while self.proc.poll() is None:
                self.relay.handle_signals()
                if watchdog is not None and self.hang is None:
                    self.hang = watchdog.check(self.relay.worker_pids)
                self.relay.cut_off_if_due(time.time())
                time.sleep(POLL_S)
            self.relay.handle_signals()
            for pump in pumps:
                pump.join(timeout=5)
        return self.proc.returncode

    def _watchdog(self) -> Watchdog | None:
        if not self.cfg.watchdog.enabled:
            return None
        nccl = self.plan.backend == "nccl"
        return Watchdog(
            self.cfg.watchdog,
            self.paths,
            self.ctx,
            world_size=self.plan.world_size,
            nccl=nccl,
            ledger=self.ledger,
            smoke_timeout_s=float(self.cfg.preflight.smoke_timeout_s),
        )

    # ---- decision (node 0) -----------------------------------------------------------------------

    def _decide(self, returncode: int) -> Decision:
        events = self.ledger.events()
        cancelled = self.relay.cancelled or any(
            e.get("event") == CANCELLED and (e.get("ts") or 0) >= self._started_at(events) for e in events
        )
        outcome = read_outcome(self.paths, self.attempt)
        if self.hang is None:  # the smoke test may have named ranks that never reached it
            self.hang = startup_hang(
                self.paths, self.attempt, outcome, window_s=self.cfg.preflight.smoke_timeout_s
            )
            if self.hang is not None:
                self.ledger.append(HANG, **self.hang.ledger_fields())
        facts = Facts(
            outcome=outcome,
            returncode=returncode,
            cancelled=cancelled,
            continue_requested=self.paths.continue_file.exists(),
            hang=self.hang.reason if self.hang is not None else None,
            hang_node=self.hang.culprit_node if self.hang is not None else None,
            user_stop=read_stop_request(self.paths.stop_file) == StopCause.USER,
            interrupted=self.relay.interrupted,
        )
        return self._decision(facts, events)

    def _started_at(self, events: list[dict[str, Any]]) -> float:
        for e in events:
            if e.get("event") == STARTED and e.get("attempt") == self.attempt:
                return float(e.get("ts") or 0)
        return 0.0

    def _decision(self, facts: Facts, events: list[dict[str, Any]] | None = None) -> Decision:
        history = History.from_events(events if events is not None else self.ledger.events())
        budgets = Budgets(
            max_requeues=self.plan.max_requeues,
            max_failure_retries=self.plan.max_failure_retries,
            max_node_excludes=self.cfg.preflight.max_node_excludes,
            max_hang_retries=self.cfg.scheduler.max_hang_retries,
        )
        return decide(facts, history, budgets, can_exclude_nodes=self.scheduler.can_exclude_nodes)

    def _carry_out(self, decision: Decision) -> int:
        """Do what ``decision`` says through the scheduler; record it; the agent's exit code."""
        self._consume_stop_request(decision)
        code = 0
        job_id = None
        by = "agent"
        try:
            if decision.action is Action.CONTINUE:
                cont = self.scheduler.continue_job(self.plan, self.paths, self.ctx)
                code, job_id, by = cont.exit_code, cont.job_id, cont.by
            elif decision.action is Action.EXCLUDE:
                self.ledger.append(NODE_EXCLUDED, nodes=list(decision.exclude), reason=decision.reason)
                cont = self.scheduler.exclude_nodes(self.plan, self.paths, self.ctx, list(decision.exclude))
                code, job_id = cont.exit_code, cont.job_id
            elif decision.action is Action.FAIL:
                code = 1
        except HpclaunchError as e:
            failed = Decision(
                Action.FAIL, decision.cause, f"{decision.reason}; continuing failed: {e.one_line()}"
            )
            self._record(failed)
            self._release_lock(None)
            return 1
        self._record(decision, job_id=job_id, by=by)
        self._release_lock(job_id if decision.action in (Action.CONTINUE, Action.EXCLUDE) else None)
        return code

    def _record(
        self, decision: Decision, *, job_id: str | None = None, by: str = "agent", note: str = ""
    ) -> None:
        fields: dict[str, Any] = {
            "cause": decision.cause,
            "reason": decision.reason,
            "action": decision.action.value,
        }
        if decision.action is Action.FAIL:
            fields["error"] = decision.reason
        if job_id is not None:
            fields["job_id"] = job_id
        if decision.action in (Action.CONTINUE, Action.EXCLUDE):
            fields["by"] = by
        if decision.exclude:
            fields["exclude"] = list(decision.exclude)
        if note:
            fields["note"] = note
        if (
            self.ctx.scheduler != "slurm"
            and decision.cause == "node_failure"
            and decision.action is Action.FAIL
        ):
            fields["note"] = f"{self.ctx.scheduler} cannot keep a continuation off a node"
        if (
            decision.cause == "hang"
            and decision.action is Action.CONTINUE
            and not self.scheduler.can_exclude_nodes
        ):
            fields["note"] = (
                f"{self.ctx.scheduler} cannot keep a continuation off a node: it may run where it hung"
            )
        self.ledger.append(decision.event, **fields)
        print(f"hpclaunch: {decision.action.value}: {decision.reason}", file=sys.stderr, flush=True)

    def _release_lock(self, next_job: str | None) -> None:
        """Hand the lock to the job that continues the run, or release it when the run stops here."""
        if self.holder is None:
            return
        with contextlib.suppress(OSError):
            if next_job is not None and next_job != "":
                self.lock.hand_over(self.holder, next_job)
            else:
                self.lock.release(self.holder)

    def _consume_stop_request(self, decision: Decision) -> None:
        """A stop request applies to the attempt that saw it; the next attempt starts clean."""
        stop = self.paths.stop_file
        if stop.exists():
            stop.rename(stop.with_name(f"stop.handled.{self.attempt}"))
        if decision.cause == "user":
            self.paths.continue_file.unlink(missing_ok=True)


def _tee(source: BinaryIO | None, log: BinaryIO, lock: threading.Lock, echo: bool) -> None:
    if source is None:
        return
    for line in iter(source.readline, b""):
        with lock:
            log.write(line)
            log.flush()
        if echo:
            try:
                sys.stdout.buffer.write(line)
                sys.stdout.flush()
            except (AttributeError, ValueError, OSError):
                pass


def agent_main(run_dir: str) -> int:
    """The node agent's entry point (``python -m hpclaunch.jobs.agent RUN_DIR``).

    ``RUN_DIR`` may be a sweep's root: each array task then runs the point its index names.
    """
    paths = RunPaths(Path(run_dir))
    plan = read_plan(paths)
    scheduler = get_scheduler(plan.scheduler)
    node = 0
    try:
        ctx = scheduler.node_context(plan, os.environ, now=time.time())
        node = ctx.node_rank
        if plan.sweep:
            plan, paths = _sweep_point(plan, ctx)
        paths = plan.paths(str(paths.root))
        cfg = read_config(paths)
        code = NodeAgent(paths, plan, cfg, ctx, scheduler).run()
        if ctx.is_head:
            after_attempt(paths)  # a run that ended here releases or cancels the runs chained after it
        return code
    except HpclaunchError as e:
        ledger = Ledger(paths, role="agent", node=node)
        # Only node 0 ends a run; another node's error is its report (torchrun fails on node 0 too).
        if node == 0:
            ledger.append("failed", cause="crash", error=e.one_line(), reason=e.one_line())
            after_attempt(paths)
        else:
            ledger.append("agent_error", error=e.one_line())
        print(f"hpclaunch: agent error: {e.one_line()}", file=sys.stderr, flush=True)
        return 1


def _sweep_point(plan: JobPlan, ctx: NodeContext) -> tuple[JobPlan, RunPaths]:
    from ..schedulers.base import NodeContextError

    if ctx.array_task is None or not 0 <= ctx.array_task < len(plan.sweep):
        raise NodeContextError(
            f"this sweep has {len(plan.sweep)} points but the job is not one of its array tasks "
            f"(array task {ctx.array_task})"
        )
    point_paths = RunPaths(Path(plan.sweep[ctx.array_task].run_dir))
    return read_plan(point_paths), point_paths


def main() -> None:
    if len(sys.argv) != 2:
        print("usage: python -m hpclaunch.jobs.agent RUN_DIR", file=sys.stderr)
        sys.exit(2)
    code = agent_main(sys.argv[1])
    ignore_late_signals()
    sys.exit(code)


def ignore_late_signals() -> None:
    """The decision is made and recorded: a warning or SIGTERM that the scheduler sends while this
    process exits must not turn its exit code (75 = continue me) into a death by signal. Python's
    shutdown resets the handlers it installed to the default action (terminate) but leaves SIG_IGN."""
    for sig in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)


if __name__ == "__main__":
    main()
