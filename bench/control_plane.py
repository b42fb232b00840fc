"""The control plane's filesystem cost, counted: N node agents (threads) of one allocation against
one run directory, each driven through the agent's own parts (``AttemptWatch.poll``, ``ended``,
``DeciderRole.await_decision``; ``await_reports``, ``Allocation.publish``) at their real intervals, with every
filesystem call under the run directory counted per agent (``fsops.Counter``).

Steady training: every agent polls as ``NodeAgent._run_attempt`` does while its ranks train (its
heartbeat, the ``end`` file, the decider's heartbeat, the watchdog: each agent reads its own ranks'
heartbeats on its node and keeps its node's file; the decider leads the watchdog: it looks whether
a node says a rank stalled and reads a few node files per second for the stragglers; the others
read the verdict file). No ranks run: their heartbeats are written once, before, in each node's
local folder (outside the run directory: not on the shared filesystem, so not counted).

One recovery: the last node's ranks fail; its agent creates ``end`` and reports; every other agent
sees ``end`` at its next look (the backstop path: ranks that would wait in a collective), reports
and waits for the decision (``DeciderRole.await_decision``); the decider waits for the reports and publishes.
"""

from __future__ import annotations

import json
import random
import threading
import time
from pathlib import Path
from typing import Any

from fsops import Counter


def node_dir(paths: Any) -> Path:
    """The simulated nodes' node-local directory (``rundir.node_dir``): beside the run directory,
    not in it, so that the counter (which counts what names a path in the run directory) leaves
    the ranks' node-local heartbeats out, as on real nodes."""
    from hpclaunch.rundir.node_dir import NodeDir

    tmp = paths.root.parent / f"node-tmp-{paths.root.name}"
    tmp.mkdir(parents=True, exist_ok=True)
    return NodeDir.prepare(tmp=tmp).path


def _agent(paths: Any, hosts: tuple[str, ...], i: int, cfg: Any, world: int, scheduler: Any = None) -> Any:
    """What a NodeAgent's poll loop touches (no plan, rank host or scheduler): its decider's part,
    its watch over the attempt (with the watchdog) and the one the decider polls while it waits for
    the reports (without)."""
    from types import SimpleNamespace

    from hpclaunch.jobs.allocation import Roster
    from hpclaunch.jobs.decider import Decider
    from hpclaunch.jobs.decider_role import DeciderRole
    from hpclaunch.jobs.node_run import NodeRun
    from hpclaunch.jobs.stop_relay import StopRelay
    from hpclaunch.jobs.watchdog import Watchdog, Watched
    from hpclaunch.jobs.watching import AttemptWatch
    from hpclaunch.rundir.progress_files import local_progress_dir
    from hpclaunch.schedulers.protocol import NodeContext

    ctx = NodeContext("local", "9", i, len(hosts), hosts[i], hosts)
    node = NodeRun.start(paths, None, ctx, scheduler)  # type: ignore[arg-type]
    relay = StopRelay(node)
    roster = Roster(hosts)
    role = DeciderRole(node, relay)
    decider = Decider(role)
    watch = AttemptWatch(node, relay=relay, role=role, roster=roster, watchdog=False)
    watched = Watched(
        world_size=world,
        local_dir=local_progress_dir(node_dir(paths), paths.root, ctx.hostname, ctx.attempt),
        local_ranks=world // len(hosts),
        alone=len(hosts) == 1,
    )
    watch.watchdog = Watchdog(cfg, paths, ctx, node.ledger, watched, lead=role.leads)
    watch.watchdog.ack_nodes = list(range(len(hosts)))
    waiting = AttemptWatch(node, relay=relay, role=role, roster=roster, watchdog=False)
    parts = {
        "ledger": node.ledger,
        "alloc": node.alloc,
        "relay": relay,
        "role": role,
        "decider": decider,
        "roster": roster,
    }
    return SimpleNamespace(ctx=ctx, watch=watch, waiting=waiting, **parts)


def simulate(
    n: int, root: Path, *, ranks_per_node: int = 8, steady_s: float = 8.0, seed: int = 0
) -> dict[str, Any]:
    """Counts for N agents: steady metadata ops/s per agent (mean and max over the non-deciding
    agents, and the decider's), and for one recovery the ops per agent, the time from the fault to
    the decision and from the publication to the last agent that saw it."""
    from hpclaunch.config import WatchdogConfig
    from hpclaunch.jobs.agent import POLL_S
    from hpclaunch.jobs.allocation import BEAT_S, LOOK_S, await_reports
    from hpclaunch.jobs.node_progress import prepare_local_dir
    from hpclaunch.rundir import RunPaths

    paths = RunPaths(root / f"agents-{n}")
    hosts = tuple(f"n{i}" for i in range(n))
    world = n * ranks_per_node
    attempt = "9.0"
    paths.attempt_dir(attempt).mkdir(parents=True, exist_ok=True)
    now = time.time()
    for rank in range(world):  # the ranks' heartbeats, on their node as the trainer leaves them
        local = prepare_local_dir(node_dir(paths), paths.root, hosts[rank // ranks_per_node], attempt)
        (local / f"rank{rank}.progress.json").write_text(
            json.dumps(
                {
                    "rank": rank,
                    "node": hosts[rank // ranks_per_node],
                    "pid": None,
                    "step": 10,
                    "phase": "compute",
                    "phase_since": now,
                    "updated": now,
                    "last_step_s": 1.0,
                    "recent_max_step_s": 1.0,
                }
            )
        )
    cfg = WatchdogConfig()
    agents = [_agent(paths, hosts, i, cfg, world) for i in range(n)]
    counter = Counter(paths.root)
    fault = threading.Event()
    ended_at = [0.0] * n
    seen_at = [0.0] * n
    published_at = [0.0]
    rng = random.Random(seed)
    offsets = [rng.uniform(0, LOOK_S) for _ in range(n)]  # agents' polls are not in phase

    def run(i: int) -> None:
        agent = agents[i]
        counter.tag(agent.ctx.hostname)
        time.sleep(offsets[i])
        next_beat = time.monotonic() + BEAT_S
        # steady training: NodeAgent._run_attempt's loop (its heartbeat thread's beats done here, so
        # that they are counted for this agent), until this node's ranks fail or it sees ``end``
        while True:
            if time.monotonic() >= next_beat:
                next_beat += BEAT_S
                agent.alloc.beat()
            agent.watch.poll(list)
            if fault.is_set() and i == n - 1:
                agent.alloc.signal_end(attempt, f"node {agent.ctx.hostname}: failed")
                break
            if agent.watch.ended():
                break
            time.sleep(POLL_S)
        ended_at[i] = time.time()
        agent.alloc.report(attempt, i, {"state": "failed", "returncode": 1})
        if agent.role.leads:
            expect = dict(enumerate(hosts))
            await_reports(agent.alloc, attempt, expect, poll=lambda: agent.waiting.poll(list))
            agent.alloc.publish(attempt, {"attempt": attempt, "in_place": True, "next": "9.0.1"})
            published_at[0] = seen_at[i] = time.time()
        else:
            agent.role.await_decision(agent.roster)
            seen_at[i] = time.time()

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
    with counter.active():
        for a in agents:  # (inside: the counter follows each agent's kept-open heartbeat file)
            a.alloc.beats.mkdir(parents=True, exist_ok=True)
            a.alloc.beat()
        for t in threads:
            t.start()
        time.sleep(LOOK_S + 1.0)  # every agent started and past its first looks
        meta0, data0 = counter.snapshot()
        t0 = time.monotonic()
        time.sleep(steady_s)
        meta1, data1 = counter.snapshot()
        window = time.monotonic() - t0
        faulted = time.time()
        fault.set()
        for t in threads:
            t.join(timeout=120)
        meta2, _ = counter.snapshot()
    rates = {h: (meta1.get(h, 0) - meta0.get(h, 0)) / window for h in hosts}
    followers = [rates[h] for h in hosts[1:]] or [0.0]
    recovery = {h: meta2.get(h, 0) - meta1.get(h, 0) for h in hosts}
    calls: dict[str, int] = {}
    for (tag, call), count in counter.calls.items():
        if tag != hosts[0]:
            calls[call] = calls.get(call, 0) + count
    return {
        "agents": n,
        "world": world,
        "window_s": window,
        "steady_per_agent": sum(followers) / len(followers),
        "steady_max_agent": max(followers),
        "steady_data_per_agent": sum(data1.get(h, 0) - data0.get(h, 0) for h in hosts[1:])
        / max(1, n - 1)
        / window,
        "steady_decider": rates[hosts[0]],
        "steady_per_node": sum(rates.values()) / n,  # the decider's share spread over the nodes
        "recovery_per_agent": sum(recovery[h] for h in hosts[1:]) / max(1, n - 1),
        "recovery_max_agent": max((recovery[h] for h in hosts[1:]), default=0),
        "recovery_decider": recovery[hosts[0]],
        "fault_to_decision_s": published_at[0] - faulted,
        "last_end_seen_s": max(ended_at) - faulted,
        "publish_to_last_s": max(seen_at) - published_at[0],
        "follower_calls": calls,
        "hung": sum(t.is_alive() for t in threads),
    }
