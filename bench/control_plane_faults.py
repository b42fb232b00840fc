"""Faults at scale, through the agents' own code (``control_plane._agent``: threads, one run
directory, every filesystem call counted by ``fsops.Counter``). Each scenario reports: how many
decisions (or start words) were made (one, under every fault), whether the run continued (every
agent followed that one), the time to decide, and the metadata operations of the decider and of
the busiest other agent while it lasted.

  paused decider   the decider's thread stops (no beat, no poll: a GC pause, a hung NFS client)
                   past DEAD_AFTER_S; the next agent takes the role and the run lock's next epoch,
                   the last node's ranks fail, the new decider decides; then the old one resumes
                   and tries to decide the same attempt (``jobs.fenced``: it follows instead)
  ESTALE bursts    the last node's ranks fail while 10 % of the path calls every agent makes fail
                   with ESTALE (``fsops.Counter.inject``): no agent may die of it
  stuck check      the start barrier of the next attempt, where one node's checks never return
                   (faked: ``run_node_checks`` blocks); its deadline fails it, the spare takes its
                   place and the decider announces one roster
  failed release   every agent is gone with its attempt undecided (the batch host died); the rescue
                   decides, and the scheduler refuses its first two ``release`` calls (a fake:
                   slurmctld is not run here)
"""

from __future__ import annotations

import errno
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from control_plane import _agent
from fsops import Counter


class NoScheduler:
    """The agents decide in place here: the scheduler is never asked."""

    can_exclude_nodes = False


def _heartbeats(paths: Any, hosts: tuple[str, ...], attempt: str, ranks_per_node: int) -> None:
    from control_plane import node_dir
    from hpclaunch.jobs.node_progress import prepare_local_dir

    now = time.time()
    for rank in range(len(hosts) * ranks_per_node):
        host = hosts[rank // ranks_per_node]
        record = {"rank": rank, "node": host, "pid": None, "step": 10, "phase": "compute"}
        (
            prepare_local_dir(node_dir(paths), paths.root, host, attempt) / f"rank{rank}.progress.json"
        ).write_text(json.dumps({**record, "phase_since": now, "updated": now, "last_step_s": 1.0}))


def _decisions(paths: Any, attempt: str) -> int:
    from hpclaunch.rundir import read_events

    kinds = ("requeued", "finished", "failed", "ended", "cancelled")
    return sum(1 for e in read_events(paths).events if e.event in kinds and e.attempt == attempt)


def _attempt_faults(n: int, root: Path, *, fault: str, ranks_per_node: int) -> dict[str, Any]:
    """``paused decider`` and ``ESTALE bursts``: N agents train, the last node's ranks fail, the
    decider decides the attempt (a crash, restarted in place) and every agent follows it."""
    from hpclaunch.config import WatchdogConfig
    from hpclaunch.jobs.agent import POLL_S
    from hpclaunch.jobs.allocation import LOOK_S, Roster, await_reports
    from hpclaunch.jobs.decision_rules import Action, Decision
    from hpclaunch.rundir import RunLock, RunPaths
    from hpclaunch.rundir.cause import Budget, Cause

    paths = RunPaths(root / f"{fault.replace(' ', '-')}-{n}")
    hosts = tuple(f"n{i}" for i in range(n))
    attempt = "9.0"
    paths.attempt_dir(attempt).mkdir(parents=True, exist_ok=True)
    _heartbeats(paths, hosts, attempt, ranks_per_node)
    agents = [_agent(paths, hosts, i, WatchdogConfig(), n * ranks_per_node, NoScheduler()) for i in range(n)]
    agents[0].role.hold(RunLock(paths).adopt(job_id="9", role="agent"))  # node 0's admission
    crash = Decision(
        Action.CONTINUE, Cause.CRASH, f"{hosts[-1]}: its ranks failed", counts_as=Budget.CRASH, in_place=True
    )
    counter = Counter(paths.root)
    go, failed, resume = threading.Event(), threading.Event(), threading.Event()
    paused = threading.Event()
    seen: dict[int, float] = {}
    died: list[str] = []
    published_at: list[float] = []

    def run(i: int) -> None:
        agent = agents[i]
        counter.tag(agent.ctx.hostname)
        try:
            while True:  # NodeAgent._run_attempt's loop while the ranks train
                if i == 0 and paused.is_set():
                    agent.alloc.stop_beating()  # stopped: no beat (its thread), no poll, until resumed
                    resume.wait()
                    paused.clear()
                    agent.alloc._stop.clear()
                    agent.alloc.start_beating()
                agent.watch.poll(list)
                if failed.is_set() and i == n - 1:
                    agent.alloc.signal_end(attempt, f"node {agent.ctx.hostname}: failed")
                    break
                if go.is_set() and agent.watch.ended():
                    break
                time.sleep(POLL_S)
            agent.alloc.report(attempt, i, {"state": "failed", "returncode": 1})
            record = agent.role.await_decision(agent.roster)  # (None: this agent decides)
            if record is None:
                await_reports(
                    agent.alloc, attempt, dict(enumerate(hosts)), poll=lambda: agent.waiting.poll(list)
                )
                record = agent.decider.publish(crash, Roster(hosts))
                if record.get("by") == agent.ctx.hostname:
                    published_at.append(time.time())
            seen[i] = time.time()
        except Exception as e:  # an agent lost to the fault: what the scenario must never show
            import traceback

            where = traceback.extract_tb(e.__traceback__)[-9:-3]
            died.append(
                f"{agent.ctx.hostname}: {type(e).__name__}: {e} at {[f'{f.name}:{f.lineno}' for f in where]}"
            )

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
    with counter.active():
        for a in agents:  # (its beats: a data write each, by the agent's beat thread, as in an agent)
            a.alloc.start_beating()
        for t in threads:
            t.start()
        go.set()
        time.sleep(LOOK_S + 1.0)
        before, _ = counter.snapshot()
        began = time.time()
        if fault == "paused decider":  # the decider stops as the attempt fails: n1 must take over
            paused.set()
        else:
            counter.inject(errno.ESTALE, 0.1)
        failed.set()
        _wait(lambda: bool(published_at) or bool(died), 300)
        if fault == "paused decider":
            resume.set()  # the deposed decider runs again, and meets the decision that stands
        for t in threads:
            t.join(timeout=300)
        counter.inject(None)
        after, _ = counter.snapshot()
        for a in agents:
            a.alloc.stop_beating()
    ops = {h: after.get(h, 0) - before.get(h, 0) for h in hosts}
    decider = agents[1].ctx.hostname if fault == "paused decider" else hosts[0]
    return {
        "fault": fault,
        "decisions": _decisions(paths, attempt),
        "continued": len(seen) == n and not died,
        "decide_s": (published_at[0] - began) if published_at else float("nan"),
        "decider_ops": ops[decider],
        "max_agent_ops": max(v for h, v in ops.items() if h != decider),
        "lost": died[:3],
        "injected": counter.failed,
    }


def _stuck_check(n: int, root: Path) -> dict[str, Any]:
    """The start barrier of an attempt: N training nodes and one spare; one node's checks never
    return. Its deadline fails it; the decider puts the spare in its place and says go."""
    import hpclaunch.preflight as preflight
    from hpclaunch.config import load_config
    from hpclaunch.jobs import node_checks
    from hpclaunch.jobs.allocation import Roster, node_ranks
    from hpclaunch.jobs.node_checks import StartBarrier, run_checks
    from hpclaunch.orchestrator.plan_build import build
    from hpclaunch.rundir import RunLock, RunPaths
    from hpclaunch.schedulers.protocol import NodeContext

    paths = RunPaths(root / f"stuck-check-{n}")
    hosts = tuple(f"n{i}" for i in range(n + 1))
    stuck = hosts[n // 2]
    cfg = load_config(None, [])
    plan = build(cfg, python="python3")
    agents = [_agent(paths, hosts, i, cfg.watchdog, n, NoScheduler()) for i in range(len(hosts))]
    agents[0].role.hold(RunLock(paths).adopt(job_id="9", role="agent"))
    roster = Roster(hosts[:n], hosts[n:])
    never = threading.Event()
    real = preflight.run_node_checks

    def checks(cfg: Any, ctx: NodeContext, **kw: Any) -> Any:
        if ctx.hostname == stuck:
            never.wait(3600)  # (a statvfs on a hung mount)
        return SimpleNamespace(checks=[], failed=[])  # (the others' checks pass at once)

    preflight.run_node_checks = checks  # type: ignore[assignment]
    deadline, node_checks.CHECKS_DEADLINE_S = node_checks.CHECKS_DEADLINE_S, 5.0
    counter = Counter(paths.root)
    words: dict[int, Any] = {}
    announced: list[float] = []

    def run(i: int) -> None:
        agent = agents[i]
        counter.tag(agent.ctx.hostname)
        barrier = StartBarrier(paths, agent.ctx.attempt)
        verdict, _ = run_checks(plan, cfg, agent.ctx)
        barrier.report(verdict)
        if i == 0:
            verdicts = barrier.gather(
                node_ranks(hosts, roster.nodes), gone=lambda h: not agent.alloc.alive(h)
            )
            word = agent.role.announce(
                barrier, go=True, roster=roster.without(verdicts.failed_nodes), reason=""
            )
            announced.append(time.time())
        else:
            word = barrier.wait_go(timeout_s=600)
        words[i] = word

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(hosts))]
    try:
        with counter.active():
            for a in agents:
                a.alloc.start_beating()
            began = time.time()
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=600)
            ops, _ = counter.snapshot()
    finally:
        never.set()
        preflight.run_node_checks = real  # type: ignore[assignment]
        node_checks.CHECKS_DEADLINE_S = deadline
        for a in agents:
            a.alloc.stop_beating()
    go = json.loads((paths.attempt_dir(agents[0].ctx.attempt) / "go.json").read_text())
    rosters = {json.dumps(w.roster, sort_keys=True) for w in words.values() if w is not None}
    return {
        "fault": "stuck check",
        "decisions": len(rosters),
        "continued": len(words) == len(hosts) and go["go"] and stuck not in go["roster"]["training"],
        "decide_s": (announced[0] - began) if announced else float("nan"),
        "decider_ops": ops.get(hosts[0], 0),
        "max_agent_ops": max(v for h, v in ops.items() if h != hosts[0]),
        "lost": [],
        "injected": 0,
    }


def _failed_release(n: int, root: Path) -> dict[str, Any]:
    """The job ended with its attempt undecided (the batch host died, every agent with it): the
    rescue decides, and its continuation's release is refused twice before it goes through."""
    from hpclaunch.config import load_config
    from hpclaunch.errors import SchedulerError
    from hpclaunch.jobs import rescue as rescue_mod
    from hpclaunch.orchestrator.launch import prepare, write_run_dir
    from hpclaunch.rundir import Ledger, LockHolder, RunLock, read_events

    hosts = [f"n{i}" for i in range(n)]
    cfg = load_config(
        None,
        [
            f"run_dir={root / f'failed-release-{n}'}",
            "scheduler.kind=slurm",
            f"scheduler.nodes={n}",
            f"train.global_batch={n}",  # (one sample per rank: the batch must divide)
        ],
    )
    prepared = prepare(cfg)
    paths = write_run_dir(cfg, prepared.plan, prepared.rendered)
    ledger = Ledger(paths, role="cli")
    ledger.append("submitting")
    ledger.append("submitted", job_id="21")
    for i in range(n):
        Ledger(paths, role="agent", attempt="21.0", node=i).append("started", job_id="21", hosts=hosts)
    beats = paths.root / "agents" / "21.0"
    beats.mkdir(parents=True, exist_ok=True)
    for host in hosts:
        (beats / host).write_text("1 1")
    RunLock(paths).set(LockHolder("21", "slurm", "agent", "elsewhere", 4242, 1.0, 1.0))
    refusals = [2]
    calls: list[str] = []

    class Slurm:
        kind = "slurm"

        def status(self, paths: Any, job_id: str) -> Any:
            from hpclaunch.schedulers.protocol import JobState, SchedulerStatus

            return SchedulerStatus(JobState.FAILED, "FAILED")

        def continuation_held(self, plan: Any, paths: Any, avoid: list[str]) -> tuple[Any, str]:
            calls.append("sbatch --hold")
            return plan, "22"

        def submit_rescue(self, plan: Any, paths: Any, job_id: str) -> str:
            return "23"

        def release(self, paths: Any, job_id: str) -> None:
            calls.append("release")
            if refusals[0] > 0:
                refusals[0] -= 1
                raise SchedulerError("scontrol release: Unable to contact slurm controller")

        def cancel(self, paths: Any, job_id: str) -> None:
            calls.append("cancel")

    real, pauses = rescue_mod.get_scheduler, rescue_mod.RELEASE_PAUSES_S
    rescue_mod.get_scheduler = lambda kind: Slurm()  # type: ignore[assignment]
    rescue_mod.RELEASE_PAUSES_S = (0.5, 0.5, 0.5, 0.5)
    counter = Counter(paths.root)
    try:
        with counter.active():
            counter.tag("rescue")
            began = time.time()
            code = rescue_mod.Rescue(paths, "21").run()
            took = time.time() - began
            counter.tag(None)
            ops, _ = counter.snapshot()
    finally:
        rescue_mod.get_scheduler, rescue_mod.RELEASE_PAUSES_S = real, pauses  # type: ignore[assignment]
    holder = RunLock(paths).read()
    decided = [e for e in read_events(paths).events if e.event == "requeued"]
    return {
        "fault": "failed release",
        "decisions": len(decided),
        "continued": code == 0
        and holder is not None
        and holder.job_id == "22"
        and calls.count("release") == 3,
        "decide_s": took,
        "decider_ops": ops.get("rescue", 0),
        "max_agent_ops": 0,
        "lost": [],
        "injected": 2,
    }


def _wait(predicate: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("the scenario did not get there")
        time.sleep(0.1)


def faults(n: int, root: Path, *, ranks_per_node: int = 8) -> list[dict[str, Any]]:
    """Every fault scenario at N agents (see the module docstring)."""
    return [
        _attempt_faults(n, root, fault="paused decider", ranks_per_node=ranks_per_node),
        _attempt_faults(n, root, fault="ESTALE bursts", ranks_per_node=ranks_per_node),
        _stuck_check(n, root),
        _failed_release(n, root),
    ]
