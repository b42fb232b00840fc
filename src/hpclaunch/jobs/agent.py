"""The node agent: one per node, started by the scheduler (srun task, mpiexec/pbsdsh, local controller),
staying for the whole allocation.

It owns everything between the scheduler and the ranks:
1. reads the plan and its NodeContext (from the scheduler module), records ``started``; starts its
   rank host (``rank_host``: the process that forks this node's ranks, warming up meanwhile);
2. node 0 first asks whether this attempt may run at all (``admission``: a run that had already
   ended is withdrawn) and takes the run-directory lock (a second writer is refused);
3. runs the node checks before every attempt (the first and each one restarted in place); on
   several nodes the decider gathers every node's verdict before anyone starts
   (``node_checks.StartBarrier``) and names the roster: the training nodes, a healthy spare in the
   place of a node that failed its checks, the other spares waiting;
4. runs one attempt: its rank host rendezvouses and forks the ranks (torch's elastic launcher,
   c10d), the agent watches it (``watching``): it relays the scheduler's warning / SIGTERM / Ctrl-C
   to them (``stop_relay``) and its watchdog (``watchdog``) stops a hung attempt;
5. after each attempt one decision (``decide``), made by the decider and published to every agent:
   in place, the agents of this allocation start the next attempt at once (a spare in a failed or
   suspect node's place: ``attribution``); through the scheduler, the decider carries it out
   (requeue, continuation job, exclusion) and every agent exits.

The decider is a role, not a host (``allocation``, ``decider_role``): the first live agent in roster
order, node 0's at first. It gathers the checks, leads the watchdog, cuts an overrunning stop save
off and decides (``decider``), whether its node trains or not; when its node leaves the roster or
dies the next agent takes the role over (and the run lock), during the checks, an attempt or a
decision alike.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path

from ..config import RunConfig
from ..errors import HpclaunchError
from ..rundir import (
    NODE_PREFLIGHT,
    NODE_REPLACED,
    STARTED,
    JobPlan,
    RunPaths,
    read_config,
    read_plan,
)
from ..rundir.attempt_records import AttemptEnd
from ..rundir.node_dir import NodeDir, node_directory
from ..schedulers.protocol import NodeContext, Scheduler
from ..schedulers.registry import get_scheduler
from .admission import admit
from .agent_exit import agent_failed
from .agent_records import started_fields
from .allocation import DecisionRecord, Roster, await_reports, node_ranks
from .attempt_env import rank_request
from .chain_end import after_attempt
from .decider import Decider
from .decider_role import DeciderRole
from .hang_evidence import stop_workers
from .node_checks import NodeVerdict, StartBarrier, Verdicts, Word, run_checks
from .node_memory import NodeMemory
from .node_progress import remove_local_dirs
from .node_run import NodeRun
from .rank_host import LogSink, RankHost
from .rank_host_start import shared_node_dir, start_rank_host
from .stop_relay import StopRelay
from .watchdog import Verdict
from .watching import AttemptWatch

POLL_S = 0.2
GO_WAIT_S = 3600.0  # how long a node waits for the start's word, take-overs included
HOST_READY_S = 600.0  # the rank host's own start (its torch import); the forkserver warms after


class NodeAgent:
    def __init__(
        self,
        paths: RunPaths,
        plan: JobPlan,
        ctx: NodeContext,
        scheduler: Scheduler,
        checked: RunConfig | None,
    ):
        self.node = NodeRun.start(paths, plan, ctx, scheduler)  # (a new one per attempt in place)
        self.relay = StopRelay(self.node)
        self.role = DeciderRole(self.node, self.relay)  # whether this agent decides, and its lock
        self.decider = Decider(self.role)  # each attempt's decision, while it does
        self.roster = Roster(ctx.hosts[: plan.nodes], ctx.hosts[plan.nodes :])
        # the memory tier's snapshots on this node
        self.memory = NodeMemory(plan.agent.memory, paths, ctx.hostname, ctx.allocation)
        self.node_dir = node_directory(in_image=plan.container is not None)  # (None: none could be made)
        self.shared_dir: NodeDir | None = None  # the node directory, once the rank host proved it shares it
        self.sink = LogSink()
        self.host: RankHost | None = None
        self.hang: Verdict | None = None  # the watchdog's verdict on this attempt
        self.stopped_by_agent = False  # this attempt's ranks were stopped here (another node ended it)
        self.attempt_watch: AttemptWatch | None = None  # this node's watch of its last attempt
        self.checked = checked  # the config the node checks evaluate (None: the plan turns them off)

    @property
    def attempt(self) -> str:
        return self.node.attempt

    # ---- main ----------------------------------------------------------------------------------

    def run(self) -> int:
        self.relay.install()
        self.node.alloc.start_beating()
        if self.node.ctx.num_nodes > 1:  # (the other agents see this one's death at once: ``links``)
            with contextlib.suppress(HpclaunchError, OSError):
                self.node.alloc.listen(self.node.scheduler.node_address(self.node.ctx.hostname))
        try:
            self.memory.start()
            self._record_started()
            barrier = StartBarrier(self.node.paths, self.attempt)
            if self.node.ctx.is_head:
                refusal = self._may_run()
                if refusal is not None:
                    if self.node.ctx.num_nodes > 1:
                        barrier.announce(go=False, reason=refusal)
                    return 0
            self.host = start_rank_host(self.node, self.node_dir, self.sink)
            started = self._start(barrier)
            if started is not None:
                return started
            return self._attempts()
        finally:
            self.memory.free()  # (the allocation ends on this node: its snapshots with it)
            self.node.alloc.stop_beating()
            self.role.close()
            if self.host is not None:
                self.host.close()
            if self.node_dir is not None:
                remove_local_dirs(
                    self.node_dir.path, self.node.paths.root, self.node.ctx.hostname, self.node.ctx.allocation
                )
                self.node_dir.remove_fallback()
            self.sink.close()

    def _start(self, barrier: StartBarrier) -> int | None:
        """Node checks and the start barrier, before every attempt: None when this node goes on to
        the attempt, else the agent's exit code (the attempt does not run)."""
        verdict = self._node_checks()
        if self.node.ctx.num_nodes == 1:
            return (
                None if verdict.ok else self.decider.carry_out(self.decider.after_checks(Verdicts([verdict])))
            )
        barrier.report(verdict)
        deadline = barrier.clock() + GO_WAIT_S  # (one wait in all, whatever take-overs fail on the way)
        while True:
            if not self.role.leads:
                left = max(0.0, deadline - barrier.clock())
                word = barrier.wait_go(timeout_s=left, take_over=lambda: self.role.gone(self.roster))
                if not word.take_over:
                    return self._heard(word)
                refusal = self._take_over_at_start()
                if refusal is False:  # (another agent claimed it first: wait on for its word)
                    continue
                if isinstance(refusal, str):
                    barrier.announce(go=False, reason=refusal)
                    return 0
            verdicts = barrier.gather(
                node_ranks(self.node.ctx.hosts, self.roster.nodes),
                gone=lambda h: not self.node.alloc.alive(h),
            )
            roster = self.roster.without(verdicts.failed_nodes)
            go = verdicts.data_error is None and not (set(roster.training) & set(verdicts.failed_nodes))
            said = self.role.announce(barrier, go=go, roster=roster, reason="a node failed its checks")
            if said is None:
                continue  # deposed before it could announce: the word comes from the one that decides
            if not said.ours or said.go:
                if said.ours:
                    self._record_replacements(self.roster, roster, verdicts)
                return self._heard(said)  # (another decider's word stands: every node follows it)
            return self.decider.carry_out(self.decider.after_checks(verdicts))

    def _heard(self, word: Word) -> int | None:
        """The start's word: None when this node goes on to the attempt (on the roster it names),
        else the agent's exit code."""
        if not word.go:
            print(f"hpclaunch: node {self.node.ctx.hostname} does not start: {word.reason}", file=sys.stderr)
            return 0
        self.roster = Roster.from_json(word.roster) if word.roster else self.roster
        self.role.follow(self.roster)
        return None

    def _attempts(self) -> int:
        """Attempts in this allocation until a decision sends the run through the scheduler; each
        one restarted in place begins with the node checks of the nodes the run is using."""
        while True:
            training = self.node.ctx.hostname in self.roster.training
            if training:
                self.memory.hold()
            result = self._run_attempt() if training else {"state": "spare"}
            self.node.alloc.report(self.attempt, self.node.ctx.node_rank, result)
            decision = self._agree(result)
            if not decision.get("in_place"):
                self.memory.free()  # the run goes on through the scheduler, or ends
                return int(decision.get("exit_code", 0)) if self.role.leads else 0
            self._next_in_place(decision)
            if self.node.ctx.hostname not in self.roster.training:
                self.memory.free()  # this node's memory serves no rank of the next attempt
            if self.node.ctx.hostname in self.roster.nodes:
                started = self._start(StartBarrier(self.node.paths, self.attempt))
                if started is not None:
                    return started

    def _take_over_at_start(self) -> bool | str:
        """The decider died during the checks and this agent is next: it takes the role (False:
        another agent claimed it first). When the run lock is still the queued job's, node 0's agent
        died before its admission: this agent admits the attempt instead (a string: why it does not
        run, recorded), so that an ended run is withdrawn and an attempt left undecided is decided."""
        before = None
        with contextlib.suppress(OSError):
            before = self.role.lock.read()
        if not self.role.take_over():
            return False
        if self.node.ctx.in_place == 0 and (before is None or before.role != "agent"):
            refusal = self._may_run(adopted=True)
            return refusal if refusal is not None else True
        return True

    # ---- may this attempt run? (node 0) ------------------------------------------------------------

    def _may_run(self, *, adopted: bool = False) -> str | None:
        """None, or why this attempt does not run (recorded; the run is left untouched).
        ``adopted``: this agent holds the lock already (it took the role over at the start)."""
        admission = admit(
            self.node,
            lock=self.role.lock,
            record=self.decider.record,
            held=self.role.holder if adopted else None,
        )
        if not adopted or admission.holder is None:
            self.role.hold(admission.holder)  # (and beat it: the run is this allocation's)
        return admission.refusal

    # ---- node checks ---------------------------------------------------------------------------

    def _node_checks(self) -> NodeVerdict:
        verdict, rows = run_checks(self.node.plan, self.checked, self.node.ctx)
        if rows:
            self.node.ledger.append(NODE_PREFLIGHT, ok=verdict.ok, checks=rows)
        return verdict

    def _record_replacements(self, planned: Roster, roster: Roster, verdicts: Verdicts) -> None:
        for bad, spare in zip(planned.training, roster.training, strict=True):
            if bad != spare:
                why = verdicts.failed_nodes.get(bad, "failed its node check")
                self.node.ledger.append(NODE_REPLACED, nodes=[bad], spare=spare, reason=f"{bad}: {why}")

    # ---- one attempt -----------------------------------------------------------------------------

    def _run_attempt(self) -> AttemptEnd:
        """Run this node's ranks for one attempt; the rank host's answer (state, returncode)."""
        assert self.host is not None
        self.hang = None
        if not self.host.alive() or not self.host.wait_ready(HOST_READY_S):
            self.host.kill()
            self.host = start_rank_host(self.node, self.node_dir, self.sink)
            if not self.host.wait_ready(HOST_READY_S):
                return {"state": "lost", "returncode": -1, "error": "the rank host did not start"}
        self.shared_dir = shared_node_dir(self.node, self.host, self.node_dir)
        request = rank_request(self.node, self.roster, self.shared_dir)
        self.sink.switch(
            self.node.paths.node_log(self.attempt, self.node.ctx.node_rank),
            f"# hpclaunch attempt {self.attempt} node {self.node.ctx.node_rank} ({self.node.ctx.hostname}): "
            f"{json.dumps({k: v for k, v in request.items() if k != 'env'})}\n",
        )
        self.relay.ranks = self.host.rank_pids
        self.relay.escalate = lambda: stop_workers(self.host.rank_pids()) if self.host else None
        watch = self._watch()
        self.host.begin(request)
        self.stopped_by_agent = False
        while (result := self.host.result()) is None:
            watch.poll(self.host.rank_pids)
            if not self.stopped_by_agent and watch.ended():
                # Another node's ranks failed: this node's cannot finish the attempt without them.
                self.stopped_by_agent = True
                stop_workers(self.host.rank_pids())
            time.sleep(POLL_S)
        self.hang = watch.hang
        watch.final()
        self.attempt_watch = watch
        self.relay.handle_signals()
        self.relay.ranks = list
        if result.get("state") != "succeeded":
            self.node.alloc.signal_end(self.attempt, f"node {self.node.ctx.hostname}: {result.get('state')}")
        return {**result, "stopped_by_agent": self.stopped_by_agent}

    def _watch(self, *, watchdog: bool = True) -> AttemptWatch:
        """This attempt's watch (``watching``), with this node's watchdog unless ``watchdog`` is False."""
        return AttemptWatch(
            self.node,
            relay=self.relay,
            role=self.role,
            roster=self.roster,
            watchdog=watchdog,
            hang=self.hang,
            node_dir=self.shared_dir.path if self.shared_dir is not None else None,
        )

    # ---- after an attempt: one decision for the whole allocation ----------------------------------

    def _agree(self, result: AttemptEnd) -> DecisionRecord:
        """The decision on this attempt, as published: made here when this agent decides, else
        waited for (and made here after all if the decider's agent is gone)."""
        published = self.role.await_decision(self.roster)
        if published is not None:
            self.decider.record_followed(published)
            return published
        alone = tuple(self.roster.training) == (self.node.ctx.hostname,)
        dead, stuck = self._await_reports() if not alone else ((), ())
        decision = self.decider.after_attempt(
            int(result.get("returncode", 1)), self.roster, dead=dead, stuck=stuck, hang=self.hang
        )
        return self.decider.publish(decision, self.roster)

    def _await_reports(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The training nodes' reports: (dead, stuck) nodes (``allocation.await_reports``). While
        the attempt still runs (this decider does not train) this agent leads the watchdog and
        relays the scheduler's signals meanwhile."""
        watch = self._watch(watchdog=self.node.ctx.hostname not in self.roster.training)
        expect = node_ranks(self.node.ctx.hosts, self.roster.training)
        reports = await_reports(self.node.alloc, self.attempt, expect, poll=lambda: watch.poll(list))
        self.hang = watch.hang
        # Every node reported, after its own last look: the summaries they published last are read
        # (by this watch when this agent does not train, else by its own attempt's).
        watch.final()
        if self.attempt_watch is not None and self.node.ctx.hostname in self.roster.training:
            self.attempt_watch.final()
        return reports

    def _next_in_place(self, record: DecisionRecord) -> None:
        """The next attempt of this allocation, on the roster the decision named."""
        self.roster = Roster.from_json(record["roster"])
        self.node = self.node.next_in_place(now=time.time())
        self.relay.next_attempt(self.node)
        self.role.next_attempt(self.node)
        self.decider.next_attempt()
        self.hang = None
        self.role.follow(self.roster)
        self._record_started(previous=record["attempt"])

    def _record_started(self, previous: str | None = None) -> None:
        self.node.ledger.append(
            STARTED, **started_fields(self.node.ctx, self.node.plan, roster=self.roster, previous=previous)
        )


def agent_main(run_dir: str) -> int:
    """The node agent's entry point (``python -m hpclaunch.jobs.agent RUN_DIR``).

    ``RUN_DIR`` may be a sweep's root: each array task then runs the point its index names.
    """
    paths = RunPaths(Path(run_dir))
    plan = read_plan(paths)
    scheduler = get_scheduler(plan.scheduler)
    node = 0
    agent: NodeAgent | None = None
    try:
        ctx = scheduler.node_context(plan, os.environ, now=time.time())
        node = ctx.node_rank
        if plan.sweep:
            plan, paths = _sweep_point(plan, ctx)
        paths = plan.paths(str(paths.root))
        # The plan is the agent's one source; the config is read once, for the node checks only.
        checked = read_config(paths) if plan.agent.node_checks else None
        agent = NodeAgent(paths, plan, ctx, scheduler, checked)
        code = agent.run()
        if agent.role.leads:  # a run that ended here releases or cancels the runs chained after it
            after_attempt(paths)
        return code
    except (HpclaunchError, OSError) as e:
        # (only the agent that decides ends the run, and only for the run's own error: agent_exit)
        decides = agent.role.leads if agent is not None else None
        return agent_failed(paths, node, e, decides=decides, attempt=agent.attempt if agent else None)


def _sweep_point(plan: JobPlan, ctx: NodeContext) -> tuple[JobPlan, RunPaths]:
    from ..schedulers.protocol import NodeContextError

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
