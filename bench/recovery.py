"""What recovering from a fault costs: from the fault to the end of the continuation's first step.

A tiny run (2 gloo ranks per node) is submitted through the real CLI, and once it has saved a
checkpoint and trained past it, a fault is made, with nothing else running from this script:

  local     local scheduler: SIGKILL one rank (a crash); the agent restarts the attempt in place;
  compile   the same crash three times: ``train.compile`` off; on with inductor's caches disabled
            (cold: every attempt compiles from nothing); on with the caches kept node-local
            (``trainer.setup.compile_cache``: warm); prints each restart's ratio to the uncompiled one;
  slurm     real local SLURM, the same crash, twice in one run of this script: restarted in place,
            and with ``scheduler.restart_in_place=false``, through ``scontrol requeue`` (SLURM's own
            requeue hold included, as a user of a real cluster pays it, before any queue wait);
  spare     real local SLURM, 3-node layout (2 training nodes + 1 hot spare), three runs of one
            configuration: every process of training node n2 killed (its agent too), the spare
            takes its place; node 0's (n1's) agent and ranks killed, another agent takes the
            decider's role and the spare n1's place; a rank's crash restarted in place on the same
            nodes (the baseline);
  agree     no training: N node agents (threads, N up to 512) against one run directory, driven
            through the agent's own poll methods (``control_plane.py``), every filesystem call
            counted (``fsops.py``): metadata ops/s per agent in steady training, ops per agent in
            one recovery, the time from the fault to the decision and from its publication to the
            last agent.

The time from the fault to the continuation's first step is cut into: detection and decision
(fault -> the ``requeued`` event), start-up (-> rank 0's ``resumed``: rendezvous, fork, model,
checkpoint load) and the first step; the steps lost since the last checkpoint are reported apart.
Beside it, ``python -c "import torch"`` measured in the same run: the process start-up this
machine imposes on any restart. Goal: an in-place restart within 1.5x that. Figures, no assertions.

    .venv/bin/python bench/recovery.py [--scenario local compile slurm spare agree] [--agents 8 32 128 512]

The SLURM scenarios need root and ``scripts/local-slurm`` (they take /tmp/hpclaunch-slurm.lock and
switch the layout they need: 1 node for ``slurm``, 3 for ``spare``).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import restart_cost
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
    from hpclaunch.rundir import RunPaths
    from hpclaunch.rundir.progress_files import read_progress

    attempt = attempts(run)[-1]
    for r, record in sorted(read_progress(RunPaths(run), attempt).items()):  # (the node agents' files)
        if (node is None or record.node == node) and (rank is None or r == rank) and record.pid:
            return int(record.pid)
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


def compile_scenario(work: Path, data: Path) -> list[tuple[str, dict[str, Any]]]:
    """The same crash with ``train.compile``: the caches off (every attempt compiles from nothing,
    as without node-local caches), then kept (``trainer.setup.compile_cache``: the restart finds the
    first attempt's compiled code), beside the uncompiled run."""
    off = crash_run(work, data, "compile-off")
    cold = crash_run(
        work, data, "compile-cold", "train.compile=true", "launch.env.TORCHINDUCTOR_FORCE_DISABLE_CACHES=1"
    )
    warm = crash_run(work, data, "compile-warm", "train.compile=true")
    return [
        ("local, crash, in place, compile off", off),
        ("local, crash, in place, compile on, cold (no caches)", cold),
        ("local, crash, in place, compile on, warm cache", warm),
    ]


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


# ---- agreement at scale, simulated: see control_plane.py ----------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--scenario",
        nargs="+",
        choices=["local", "compile", "slurm", "spare", "agree"],
        default=["local", "agree"],
    )
    ap.add_argument("--agents", nargs="+", type=int, default=[8, 32, 128, 512])
    ap.add_argument(
        "--ranks-per-node", type=int, default=8, help="agree: ranks whose progress the decider reads"
    )
    ap.add_argument("--steady-s", type=float, default=8.0, help="agree: the measured steady window")
    ap.add_argument(
        "--fault-agents",
        type=int,
        default=None,
        help="agree: agents in the fault table (default: the largest N)",
    )
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="the smallest sizes, in seconds: that it runs (make test), no figures",
    )
    args = ap.parse_args()
    if args.smoke:
        args.scenario, args.agents, args.steady_s = ["local", "agree"], [4], 1.0
        restart_cost.REPEATS = 1  # (the process-start figures: one sample each)
    if set(args.scenario) & {"local", "compile", "slurm", "spare"}:
        torch_s = import_torch_s()
        print(f'python -c "import torch": {torch_s:.2f} s (median of 3, this run)')
    with tempfile.TemporaryDirectory(
        prefix="hpclaunch-recovery-", dir="/tmp", ignore_cleanup_errors=True
    ) as tmp:
        work = Path(tmp)
        rows: list[tuple[str, dict[str, Any]]] = []
        if set(args.scenario) & {"local", "compile", "slurm", "spare"}:
            data = work / "data"
            cli("data", "synth", str(data), "--samples", "512", "--seed", "0", cwd=work)
        scenarios = (
            ("local", local_scenario),
            ("compile", compile_scenario),
            ("slurm", slurm_scenario),
            ("spare", spare_scenario),
        )
        for name, fn in scenarios:
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
            by_label = dict(rows)
            crash = by_label.get("SLURM 2+1 nodes, crash, in place (same nodes)")
            for label, r in rows if crash is not None else ():
                if "dead" in label:  # issue 36: a node's death against a crash, side by side (goal: <= 2x)
                    print(
                        f"{label}: {r['total']:.2f} s against the crash in place's {crash['total']:.2f} s: "
                        f"{r['total'] / crash['total']:.2f}x (detection and decision {r['decision']:.2f} s)"
                    )
            off = by_label.get("local, crash, in place, compile off")
            if off is not None:
                for kind in ("cold", "warm"):
                    label = next(
                        k
                        for k in by_label
                        if k.endswith("cold (no caches)" if kind == "cold" else "warm cache")
                    )
                    ratio = by_label[label]["total"] / off["total"]
                    print(f"compile on, {kind}: the in-place restart takes {ratio:.2f}x the uncompiled one")
        if "agree" in args.scenario:
            from control_plane import simulate

            print(
                "\nthe control plane's metadata operations on the shared filesystem (counted, bench/fsops.py),"
                f"\n{args.ranks_per_node} ranks per node, steady window {args.steady_s:.0f} s; ops/s per agent: the"
                " non-deciding agents' mean (max); the decider leads the watchdog (one node file per second in turn)"
            )
            print(
                f"{'agents':>6s} {'steady ops/s per agent':>23s} {'decider':>8s} {'per node':>9s} "
                f"{'recovery ops per agent':>23s} {'decider':>8s} {'fault->decision':>16s} {'publish->last agent':>20s}"
            )
            for n in args.agents:
                c = simulate(n, work, ranks_per_node=args.ranks_per_node, steady_s=args.steady_s)
                print(
                    f"{n:6d} {c['steady_per_agent']:15.2f} ({c['steady_max_agent']:4.2f}) {c['steady_decider']:8.1f} "
                    f"{c['steady_per_node']:9.2f} {c['recovery_per_agent']:15.1f} ({c['recovery_max_agent']:4d}) "
                    f"{c['recovery_decider']:8d} {c['fault_to_decision_s']:14.2f} s {c['publish_to_last_s']:18.2f} s"
                    + (f"  ({c['hung']} agents never saw the decision)" if c["hung"] else ""),
                    flush=True,
                )
            from control_plane_faults import faults

            n = args.fault_agents or max(args.agents)
            print(
                f"\nfaults at {n} agents, through the agents' own code (bench/control_plane_faults.py): one "
                "decision (or start word) each, the run continued, the time to decide, metadata ops while it lasted"
            )
            print(
                f"{'fault':16s} {'decisions':>9s} {'continued':>9s} {'to decide':>10s} {'decider ops':>11s} {'max agent ops':>13s}"
            )
            for f in faults(n, work, ranks_per_node=args.ranks_per_node):
                lost = f"  lost: {f['lost']}" if f["lost"] else ""
                print(
                    f"{f['fault']:16s} {f['decisions']:9d} {'yes' if f['continued'] else 'NO':>9s} "
                    f"{f['decide_s']:8.2f} s {f['decider_ops']:11d} {f['max_agent_ops']:13d}{lost}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
