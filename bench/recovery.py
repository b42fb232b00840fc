"""What recovering from a fault costs: from the fault to the end of the continuation's first step.

A tiny run (2 gloo ranks per node) is submitted through the real CLI, and once it has saved a
checkpoint and trained past it, a fault is made, with nothing else running from this script:

  local     local scheduler: SIGKILL one rank (a crash); the agent restarts the attempt in place;
  slurm     real local SLURM, the same crash, twice in one run of this script: restarted in place,
            and with ``scheduler.restart_in_place=false``, through ``scontrol requeue`` (SLURM's own
            requeue hold included, as a user of a real cluster pays it, before any queue wait);
  spare     real local SLURM, 3-node layout (2 training nodes + 1 hot spare), three runs of one
            configuration: every process of training node n2 killed (its agent too), the spare
            takes its place; node 0's (n1's) agent and ranks killed, another agent takes the
            decider's role and the spare n1's place; a rank's crash restarted in place on the same
            nodes (the baseline);
  agree     no training: N simulated node agents (threads, N up to 512) against one run directory:
            the decider reads N reports and publishes its decision, the others poll for it. Time to
            agreement, and the filesystem operations one agent makes per poll.

The time from the fault to the continuation's first step is cut into: detection and decision
(fault -> the ``requeued`` event), start-up (-> rank 0's ``resumed``: rendezvous, fork, model,
checkpoint load) and the first step; the steps lost since the last checkpoint are reported apart.
Beside it, ``python -c "import torch"`` measured in the same run: the process start-up this
machine imposes on any restart. Goal: an in-place restart within 1.5x that. Figures, no assertions.

    .venv/bin/python bench/recovery.py [--scenario local slurm spare agree] [--agents 8 32 128 512]

The SLURM scenarios need root and ``scripts/local-slurm`` (they take /tmp/hpclaunch-slurm.lock and
switch the layout they need: 1 node for ``slurm``, 3 for ``spare``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from restart_cost import cli, import_torch_s, ledger, metrics, slurm_lock, wait

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "tiny.yaml"
COMMON = (
    "train.log_every=1",
    "checkpoint.every_steps=20",
    "testing.step_sleep_s=0.05",
    "train.steps=80",
    "scheduler.max_failure_retries=3",
    "scheduler.time_limit=10m",
)
FAULT_AFTER = 25  # steps: past the checkpoint at 20, so 5 steps are lost


def submit(work: Path, data: Path, name: str, *extra: str) -> Path:
    run = work / "runs" / name
    sets = [
        f"name={name}",
        f"run_dir={run}",
        f"data.token_dir={data / 'tokens'}",
        f"data.latent_dir={data / 'latents'}",
    ]
    sets += [*COMMON, *extra]
    cli("submit", str(TINY), "--no-preflight", *[x for s in sets for x in ("--set", s)], cwd=work)
    return run


def attempts(run: Path) -> list[str]:
    return list(dict.fromkeys(e["attempt"] for e in ledger(run) if e.get("event") == "started"))


def last_step(run: Path) -> int:
    lines = metrics(run)
    return int(lines[-1]["step"]) if lines else 0


def ended(run: Path) -> bool:
    return any(e.get("event") in ("finished", "failed", "ended", "cancelled") for e in ledger(run))


def rank_on(run: Path, node: str | None = None, rank: int | None = None) -> int:
    """The pid of a rank of the current attempt (by node or by rank) from its progress heartbeat."""
    attempt = attempts(run)[-1]
    for path in sorted((run / "attempts" / attempt).glob("rank*.progress.json")):
        record = json.loads(path.read_text())
        if (node is None or record.get("node") == node) and (rank is None or record.get("rank") == rank):
            return int(record["pid"])
    raise LookupError(f"no rank on {node} in {attempt}")


def recovery(run: Path, faulted: float) -> dict[str, Any]:
    """The fault -> the continuation's first step, cut into parts by the run's own ledger."""
    keys = attempts(run)
    first, second = keys[0], keys[1]
    decided = next(e for e in ledger(run) if e.get("event") == "requeued" and e.get("attempt") == first)
    resumed = next(e for e in ledger(run) if e.get("event") == "resumed" and e.get("attempt") == second)
    first_line = next(m for m in metrics(run) if m.get("attempt") == second)
    computed = max((int(m["step"]) for m in metrics(run) if m.get("attempt") == first), default=0)
    return {
        "total": float(first_line["ts"]) - faulted,
        "decision": float(decided["ts"]) - faulted,
        "startup": float(resumed["ts"]) - float(decided["ts"]),
        "first_step": float(first_line["ts"]) - float(resumed["ts"]),
        "lost_steps": computed - int(resumed.get("step") or 0),
        "in_place": bool(decided.get("in_place")),
        "cause": decided.get("cause"),
        "startup_parts": resumed.get("startup_s"),
    }


def crash_run(work: Path, data: Path, name: str, *extra: str) -> dict[str, Any]:
    run = submit(work, data, name, *extra)
    wait(lambda: last_step(run) >= FAULT_AFTER, f"{name}: step {FAULT_AFTER}", timeout=600, poll=0.05)
    pid = rank_on(run, rank=1)
    faulted = time.time()
    os.kill(pid, signal.SIGKILL)
    wait(lambda: ended(run), f"{name}: the run's end", timeout=900)
    return recovery(run, faulted)


def local_scenario(work: Path, data: Path) -> list[tuple[str, dict[str, Any]]]:
    return [("local scheduler, crash, in place", crash_run(work, data, "local-crash"))]


def layout(nodes: int) -> None:
    subprocess.run(
        [str(ROOT / "scripts" / "local-slurm"), "up", "--nodes", str(nodes)], check=True, capture_output=True
    )


def slurm_scenario(work: Path, data: Path) -> list[tuple[str, dict[str, Any]]]:
    with slurm_lock():
        layout(1)
        in_place = crash_run(work, data, "slurm-in-place", "scheduler.kind=slurm")
        requeue = crash_run(
            work, data, "slurm-requeue", "scheduler.kind=slurm", "scheduler.restart_in_place=false"
        )
    return [("SLURM, crash, in place", in_place), ("SLURM, crash, scontrol requeue", requeue)]


def kill_node(namespace: str, *, python_only: bool = False) -> float:
    """SIGKILL every process of the job in a node's network namespace but SLURM's daemons
    (``python_only``: the agent and what it started; the batch script and srun live on). The time
    of the kill."""
    import psutil

    pids = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True).stdout.split()
    doomed = []
    for pid in map(int, pids):
        try:
            cmd = " ".join(psutil.Process(pid).cmdline())
        except psutil.Error:
            continue
        # (srun's own command line names python too: only a python process itself is the agent's)
        if (
            "slurmd" not in cmd
            and "slurmstepd" not in cmd
            and (not python_only or "python" in cmd.split(" ")[0])
        ):
            doomed.append(pid)
    faulted = time.time()
    for pid in doomed:
        with __import__("contextlib").suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return faulted


def spare_scenario(work: Path, data: Path) -> list[tuple[str, dict[str, Any]]]:
    """One configuration (2 training nodes + 1 hot spare), three faults: a worker node's death, the
    head's agent and ranks dying (another agent takes the decider's role), and a rank's crash
    restarted in place on the same nodes, as the baseline."""
    spare = ("scheduler.kind=slurm", "scheduler.nodes=2", "scheduler.spare_nodes=1")
    results = []
    with slurm_lock():
        layout(3)
        try:
            for name, namespace, python_only in (
                ("SLURM 2+1 nodes, worker n2 dead, spare in place", "hpcl2", False),
                ("SLURM 2+1 nodes, head n1's agent+ranks dead, spare", "hpcl1", True),
            ):
                run = submit(work, data, f"spare-{namespace}", *spare)
                wait(
                    lambda run=run: last_step(run) >= FAULT_AFTER, f"{name}: step 25", timeout=600, poll=0.05
                )
                faulted = kill_node(namespace, python_only=python_only)
                wait(lambda run=run: ended(run), f"{name}: the run's end", timeout=900)
                results.append((name, recovery(run, faulted)))
            results.append(
                (
                    "SLURM 2+1 nodes, crash, in place (same nodes)",
                    crash_run(work, data, "spare-crash", *spare),
                )
            )
        finally:
            layout(1)
    return results


# ---- agreement at scale, simulated ----------------------------------------------------------------


def agree(n: int, root: Path) -> dict[str, float]:
    """N agents of one allocation (threads) and one attempt: everyone reports, the decider reads the
    reports and publishes, the others see it. Returns seconds and per-poll filesystem work."""
    from hpclaunch.jobs.agent import POLL_S
    from hpclaunch.jobs.allocation import Allocation
    from hpclaunch.rundir import RunPaths

    paths = RunPaths(root / f"agree-{n}")
    hosts = tuple(f"n{i}" for i in range(n))
    agents = [Allocation(paths, "9.0", h, hosts) for h in hosts]
    for a in agents:
        a.beats.mkdir(parents=True, exist_ok=True)
        a.beat()
    attempt = "9.0"
    seen: list[float] = [0.0] * n
    published = threading.Event()

    def follower(i: int) -> None:
        agents[i].report(attempt, i, {"state": "failed", "returncode": 1})
        while agents[i].decision(attempt) is None:
            time.sleep(POLL_S)
        seen[i] = time.time()

    threads = [threading.Thread(target=follower, args=(i,)) for i in range(1, n)]
    t0 = time.time()
    for t in threads:
        t.start()
    decider = agents[0]
    decider.report(attempt, 0, {"state": "failed", "returncode": 1})
    while len(decider.reports(attempt, range(n))) < n:  # the decider waits for every report
        time.sleep(POLL_S)
    gathered = time.time()
    t_read = time.perf_counter()
    decider.reports(attempt, range(n))
    alive = sum(decider.alive(h) for h in hosts)
    read_s = time.perf_counter() - t_read
    decider.publish(attempt, {"attempt": attempt, "in_place": True, "next": "9.0.1"})
    t_pub = time.time()
    published.set()
    for t in threads:
        t.join()
    return {
        "agents": n,
        "reports_gathered_s": gathered - t0,
        "decider_reads_s": read_s,
        "alive": alive,
        "publish_to_last_follower_s": max(seen[1:], default=t_pub) - t_pub,
        "ops_per_poll_per_agent": 1,  # one stat() of decision.json (a failed open) per 0.2 s
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--scenario", nargs="+", choices=["local", "slurm", "spare", "agree"], default=["local", "agree"]
    )
    ap.add_argument("--agents", nargs="+", type=int, default=[8, 32, 128, 512])
    args = ap.parse_args()
    torch_s = import_torch_s()
    print(f'python -c "import torch": {torch_s:.2f} s (median of 3, this run)')
    with tempfile.TemporaryDirectory(prefix="hpclaunch-recovery-", dir="/tmp") as tmp:
        work = Path(tmp)
        rows: list[tuple[str, dict[str, Any]]] = []
        if set(args.scenario) & {"local", "slurm", "spare"}:
            data = work / "data"
            cli("data", "synth", str(data), "--samples", "512", "--seed", "0", cwd=work)
        for name, fn in (("local", local_scenario), ("slurm", slurm_scenario), ("spare", spare_scenario)):
            if name in args.scenario:
                rows += fn(work, data)
        if rows:
            print(
                f"\n{'scenario':48s} {'fault->1st step':>15s} {'x import torch':>15s} {'decide':>7s} {'start':>7s} {'step':>6s} lost"
            )
            for label, r in rows:
                ratio = r["total"] / torch_s
                print(
                    f"{label:48s} {r['total']:13.2f} s {ratio:14.2f}x {r['decision']:6.2f}s {r['startup']:6.2f}s "
                    f"{r['first_step']:5.2f}s {r['lost_steps']} steps ({'in place' if r['in_place'] else 'requeued'}, {r['cause']})"
                )
                print(f"{'':48s} start-up parts: {r['startup_parts']}")
        if "agree" in args.scenario:
            print(
                f"\n{'agents':>6s} {'all reported':>13s} {'decider reads N':>16s} {'publish->last agent':>20s} {'fs ops/poll/agent':>18s}"
            )
            curve = [agree(n, work) for n in args.agents]
            for c in curve:
                print(
                    f"{c['agents']:6d} {c['reports_gathered_s']:11.3f} s {c['decider_reads_s']:14.4f} s "
                    f"{c['publish_to_last_follower_s']:18.3f} s {c['ops_per_poll_per_agent']:18d}"
                )
            med = statistics.median(c["publish_to_last_follower_s"] for c in curve)
            print(f"median publish->last agent over the curve: {med:.3f} s (poll interval 0.2 s)")


if __name__ == "__main__":
    main()
