"""The memory tier's cost and gain, in one run: snapshot stall against a step, and the steps lost per
failure with the memory tier and without it.

One run of the tiny model (torchrun, 2 gloo ranks) with checkpoints on disk
every ``--disk`` steps and snapshots in memory every ``--memory`` steps. Rank 0 is SIGKILLed at a
random moment ``--kills`` times; after each kill the next attempt resumes. Each resume's ledger line
says both what it resumed from (the newest complete snapshot, when newer than the disk) and the
newest checkpoint on disk at that moment: so the steps lost *without* the memory tier are measured in
the same run, at the same kill (the last step the killed attempt logged, minus the disk's step),
beside the steps lost with it (minus the step resumed from). The stall is the ledger's
``snapshot_saved.stall_s`` and ``copy_wait_s`` (what training waited for: the state dict and the
staging layout after the step, the staging copies at the next optimizer update), against the median
step; and the step after a snapshot against the others (the snapshot's job runs beside it).

The whole cost is what the tier takes from training: the stall plus the slowdown of the steps its
job ran beside (``snapshot_saved.whole_s``, measured by rank 0's trainer against its steady steps),
per snapshot, per step (over the interval) and as a share of the training time.
``--memory auto`` lets the trainer choose the interval from that cost and the MTBF
(``--mtbf-hours``, per node).

    .venv/bin/python bench/memory_tier.py --kills 4 [--nodes 2] [--memory auto --mtbf-hours 0.05]
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hpclaunch.config import load_config
from hpclaunch.fsutil import read_jsonl
from hpclaunch.rundir import RunPaths, read_events
from hpclaunch.rundir.env import NODE_NAME_VAR
from hpclaunch.rundir.progress_files import read_progress
from hpclaunch.shards import synth_dataset


class Attempt:
    """One attempt: torchrun with 2 ranks on one node, or (``nodes`` 2) two torchruns of one rank each
    on this machine, each naming its node as the node agent would, so that every snapshot is also
    sent to the other "node" (the buddy) over gloo and kept in that node's store."""

    def __init__(self, run: Path, attempt: str, nodes: int) -> None:
        env = {**os.environ, "HPCLAUNCH_ATTEMPT": attempt, "OMP_NUM_THREADS": "1"}
        env.pop("HPCLAUNCH_ATTEMPT_CLOCK", None)
        runner = [sys.executable, "-m", "torch.distributed.run"]
        trainer = ["-m", "hpclaunch.trainer", str(run)]
        if nodes == 1:
            commands = [([*runner, "--standalone", "--nproc-per-node=2", *trainer], env)]
        else:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            rendezvous = [
                "--nnodes=2",
                "--nproc-per-node=1",
                "--master-addr=127.0.0.1",
                f"--master-port={port}",
            ]
            commands = [
                ([*runner, *rendezvous, f"--node-rank={n}", *trainer], {**env, NODE_NAME_VAR: f"node{n}"})
                for n in range(2)
            ]
        self.procs = [
            subprocess.Popen(
                c, env=e, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
            )
            for c, e in commands
        ]

    def poll(self) -> int | None:
        codes = [p.poll() for p in self.procs]
        return None if None in codes else max(c or 0 for c in codes)

    def wait(self) -> None:
        for p in self.procs:
            p.wait()


def resumes_so_far(run: Path) -> dict[str, int]:
    """Each attempt's resumed step, once it has logged it (waits for none)."""
    return {e.attempt or "": int(e.record["step"]) for e in read_events(RunPaths(run)).named("resumed")}


def rank_pid(run: Path, attempt: str, rank: int) -> int:
    """The pid rank ``rank`` of ``attempt`` names in its progress heartbeat."""
    record = read_progress(RunPaths(run), attempt)[rank]  # (its node agent's file)
    return int(record.pid or 0)


def last_step(run: Path, attempt: str) -> int:
    """The last step rank 0 of ``attempt`` finished, by its progress heartbeat (metrics are buffered)."""
    record = read_progress(RunPaths(run), attempt).get(0)
    return record.step if record is not None else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kills", type=int, default=4)
    ap.add_argument("--steps", type=int, default=240)
    ap.add_argument("--disk", type=int, default=40, help="checkpoint.every_steps")
    ap.add_argument("--memory", default="5", help="checkpoint.memory.every_steps (a number, or auto)")
    ap.add_argument("--mtbf-hours", type=float, default=5000.0, help="checkpoint.mtbf_hours (per node)")
    ap.add_argument("--step-sleep", type=float, default=0.0, help="testing.step_sleep_s (the math unchanged)")
    ap.add_argument("--nodes", type=int, default=1, choices=(1, 2), help="2: each snapshot also to a buddy")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep", default=None, help="work here and keep it (the attempts' logs)")
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="the smallest sizes, in seconds: that it runs (make test), no figures",
    )
    args = ap.parse_args()
    if args.smoke:
        args.kills, args.steps, args.disk, args.memory = 1, 24, 8, "4"
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.keep) if args.keep else Path(tmp)
        data = root / "data"
        synth_dataset(data, samples=512, seed=0, model_cfg=load_config(None).model, shard_size=128)
        run = root / "run"
        sets = [
            "scheduler.gpus_per_node=0", f"scheduler.procs_per_node={2 // args.nodes}",
            *(["scheduler.kind=slurm", "scheduler.nodes=2"] if args.nodes == 2 else []), f"train.steps={args.steps}",
            "train.global_batch=16", "train.micro_batch=8", "train.log_every=1",
            "preflight.distributed_smoke=false", f"checkpoint.every_steps={args.disk}",
            f"checkpoint.memory.every_steps={args.memory}", f"checkpoint.memory.dir={root / 'shm'}",
            f"checkpoint.mtbf_hours={args.mtbf_hours}",
            f"testing.step_sleep_s={args.step_sleep}", f"data.token_dir={data / 'tokens'}",
            f"data.latent_dir={data / 'latents'}", f"run_dir={run}",
        ]  # fmt: skip
        cfg = load_config(None, sets, base=root)
        (root / "shm").mkdir(exist_ok=True)
        RunPaths(run).ensure()
        (run / "config.yaml").write_text(cfg.to_yaml())
        killed_at: dict[str, int] = {}
        for i in range(1, args.kills + 2):
            attempt = f"a{i}"
            proc = Attempt(run, attempt, args.nodes)
            if i <= args.kills:
                # a random moment at least two disk intervals past this attempt's start
                begun = int(resumes_so_far(run).get(attempt, 0))
                target = min(args.steps - 5, begun + rng.randint(args.disk + 1, 2 * args.disk))
                while last_step(run, attempt) < target and proc.poll() is None:
                    time.sleep(0.01)
                killed_at[attempt] = last_step(run, attempt)
                # rank 0 itself, as an OOM kill would (torchrun then ends its peer): the ranks are
                # not in torchrun's process group, so killing that group would leave them training
                pid = rank_pid(run, attempt, 0)
                os.kill(pid, signal.SIGKILL)
            proc.wait()
        events = read_events(RunPaths(run)).events
        resumes = {e.attempt: e.record for e in events if e.event == "resumed"}
        with_tier, without = [], []
        for i in range(1, args.kills + 1):
            r = resumes[f"a{i + 1}"]
            died = killed_at[f"a{i}"]
            with_tier.append(died - int(r["step"]))
            without.append(died - int(r.get("disk_step") or 0))
        snapshot_events = [e.record for e in events if e.event == "snapshot_saved"]
        snapshot_steps = {int(e["step"]) for e in snapshot_events}
        # what training waited for: after the step (state dict, layout) and at the next update (copies)
        jobs = [e["seconds"] for e in snapshot_events if e.get("seconds") is not None]
        stalls = [e["stall_s"] + (e.get("copy_wait_s") or 0.0) for e in snapshot_events if e.get("stall_s")]
        wholes = [e["whole_s"] for e in snapshot_events if e.get("whole_s") is not None]
        intervals = [e.record["interval_steps"] for e in events if e.event == "snapshot_interval"]
        parts: dict[str, list[float]] = {}
        for e in snapshot_events:
            for k, v in {**(e.get("stall_parts") or {}), "copy_wait": e.get("copy_wait_s") or 0.0}.items():
                parts.setdefault(k, []).append(v)
        # the step's own time: without the test sleep, if one was asked for (never flattered by it)
        timed = [
            (int(m["step"]), m["step_time_s"] - args.step_sleep)
            for m in read_jsonl(RunPaths(run).metrics)
            if m.get("step_time_s")
        ]
        steps = [t for _, t in timed]
        # the step after a snapshot, while its job (own copy, the buddy's) runs beside training
        after = [t for n, t in timed if n - 1 in snapshot_steps]
        others = [t for n, t in timed if n not in snapshot_steps and n - 1 not in snapshot_steps]
        finished = (run / "attempts" / f"a{args.kills + 1}.json").exists()
    step = statistics.median(steps)
    stall = statistics.median(stalls) if stalls else float("nan")
    where = (
        "2 nodes of 1 rank (each snapshot also sent to the buddy)" if args.nodes == 2 else "1 node, 2 ranks"
    )
    every = f"{args.memory}" if args.memory != "auto" else f"auto ({', '.join(map(str, intervals[-3:]))}...)"
    print(f"{where}; {args.kills} kills, disk every {args.disk} steps, memory every {every}, "
          f"load {os.getloadavg()[0]:.1f}")  # fmt: skip
    print(f"  steps lost per failure: with the memory tier {statistics.mean(with_tier):.1f} {with_tier}")
    print(f"                          without it (disk only) {statistics.mean(without):.1f} {without}")
    print(f"  snapshot stall {stall * 1000:.2f} ms (median of {len(stalls)}), median step {step * 1000:.1f} ms: "
          f"{stall / step:.1%} of a step")  # fmt: skip
    # the whole cost over the steps trained: every snapshot's, spread over the steps between them
    per_snapshot = statistics.mean(wholes)
    per_step = per_snapshot * len(wholes) / len(steps)
    print(f"  whole cost {per_snapshot * 1000:.1f} ms a snapshot (stall and the slowdown of the steps beside "
          f"its job; mean of {len(wholes)}): {per_step * 1000:.2f} ms a step, {per_step / step:.1%} of training time")  # fmt: skip
    slower = statistics.median(after) / statistics.median(others) - 1
    print(f"  the step after a snapshot (its job runs beside it): {statistics.median(after) * 1000:.1f} ms "
          f"against {statistics.median(others) * 1000:.1f} ms ({slower:+.1%})")  # fmt: skip
    shown = ", ".join(f"{k} {statistics.median(v) * 1000:.2f}" for k, v in parts.items())
    print(f"  the stall's parts, medians in ms: {shown}")
    print(
        f"  a snapshot's job (copies, checksum, description, own write, buddy's send and receive): median {statistics.median(jobs) * 1000:.1f} ms"
    )
    assert finished


if __name__ == "__main__":
    main()
