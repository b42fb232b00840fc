#!/usr/bin/env python3
"""What the watchdog costs, and how long a hang takes from its start to the continuation's first step.

1. Cost on step time, two ways:
   (a) by its parts, each timed in a tight loop: the progress reporter's calls a step makes (phase
       changes and ``stepped``), one heartbeat write (once a second, in a thread of each rank), one
       watchdog poll of node 0's agent (every ``poll_s``, another process); summed as a fraction of
       the tiny model's step time (the heartbeat and the poll counted as if they stole their whole
       time from the training thread, an upper bound);
   (b) end to end: ``hpclaunch train`` of the same tiny run with ``watchdog.enabled`` true and
       false, alternating for ``--rounds`` pairs (paired runs see similar background load); per
       run the median of rank 0's per-window step times (first window left out); printed: every
       pair's ratio and their median. On a shared 2-core machine single pairs swing by +-10 % and
       more, far above the cost measured in (a): (b) is a sanity check, (a) the figure.
2. A hang: the tiny run on the local scheduler with rank 1 made to hang in the data phase of step
   ``--hang-at``, the watchdog at its defaults unless ``--step-min-s`` says otherwise. Printed, from
   the ledger, the hung rank's own report and the metrics file (watched every 50 ms):
   detection (the rank stops -> the verdict), dump (stacks written), teardown (workers stopped,
   rank host gone, decision recorded), restart (the next attempt's process start, start-up with
   checkpoint load, and its first step).

    .venv/bin/python bench/watchdog.py [--rounds 3] [--steps 200] [--hang-at 30] [--step-min-s 60]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from hpclaunch.rundir import RunPaths
from hpclaunch.rundir.progress_files import read_progress

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "tiny.yaml"


def cli(*args: str, cwd: Path) -> str:
    out = subprocess.run([sys.executable, "-m", "hpclaunch", *args], cwd=cwd, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(
            f"hpclaunch {' '.join(args[:2])} failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}"
        )
    return out.stdout


def sets(*items: str) -> list[str]:
    return [x for item in items for x in ("--set", item)]


def common(work: Path, data: Path, name: str) -> list[str]:
    return sets(
        f"name={name}",
        f"run_dir={work / 'runs' / name}",
        f"data.token_dir={data / 'tokens'}",
        f"data.latent_dir={data / 'latents'}",
    )


def events(run: Path) -> list[dict[str, Any]]:
    from hpclaunch.rundir import RunPaths, read_events

    return [e.record for e in read_events(RunPaths(run)).events]


# ---- 1. cost -----------------------------------------------------------------------------------


def reporter_cost_us(steps: int = 200_000) -> tuple[float, float, float]:
    """Microseconds the progress reporter adds to one step (its thread writing meanwhile), and one
    heartbeat write's CPU and wall microseconds (the wall part waits for the filesystem in the
    heartbeat thread, off the training thread: the write releases the GIL)."""
    from hpclaunch.rank.progress import Progress

    with tempfile.TemporaryDirectory() as tmp:
        p = Progress(
            Path(tmp) / "rank0.progress.json", rank=0, steptimes=Path(tmp) / "rank0.jsonl", summary_every=50
        ).start()
        t0 = time.perf_counter()
        for step in range(1, steps + 1):
            p.phase("data", step)
            p.phase("compute")
            p.phase("collective")
            p.stepped(step, 0.01)
            p.phase("collective")  # the stop check
        per_step = (time.perf_counter() - t0) / steps * 1e6
        p.close()  # the heartbeat thread stops: the beats below are timed alone (and never race
        # it for the same temporary file, which made this bench fail now and then)
        beats = 1000
        t0, c0 = time.perf_counter(), time.thread_time()
        for _ in range(beats):
            p._write()
        beat_cpu = (time.thread_time() - c0) / beats * 1e6
        beat_wall = (time.perf_counter() - t0) / beats * 1e6
    return per_step, beat_cpu, beat_wall


def poll_cost_us(world_size: int, polls: int = 500) -> float:
    """CPU microseconds of one watchdog poll on node 0 over ``world_size`` ranks' files."""
    from hpclaunch.config import WatchdogConfig
    from hpclaunch.jobs.watchdog import Watchdog, Watched
    from hpclaunch.rundir import Ledger, RunPaths
    from hpclaunch.rundir.progress_files import progress_file
    from hpclaunch.schedulers.protocol import NodeContext

    with tempfile.TemporaryDirectory() as tmp:
        paths = RunPaths(Path(tmp)).ensure()
        ctx = NodeContext("local", "b", 0, 1, "n1", ("n1",))
        for rank in range(world_size):
            path = progress_file(paths, ctx.attempt, rank)
            path.parent.mkdir(parents=True, exist_ok=True)
            record = {"rank": rank, "node": "n1", "pid": 1, "step": 5, "phase": "compute", "phase_since": 1.0}
            path.write_text(json.dumps({**record, "updated": 1.0, "last_step_s": 0.03}))
        cfg = WatchdogConfig(step_min_s=10**9)  # the stalled files must never become a hang here
        dog = Watchdog(cfg, paths, ctx, Ledger(paths, role="b"), Watched(world_size=world_size))
        now = time.time()
        c0 = time.process_time()
        for i in range(polls):
            dog.check(lambda: [], now=now + (i + 1) * cfg.poll_s)  # always due
        return (time.process_time() - c0) / polls * 1e6


def median_step_s(run: Path) -> float:
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return statistics.median(x["step_time_s"] for x in lines[1:] if x.get("step_time_s"))


def cost(work: Path, data: Path, rounds: int, steps: int) -> None:
    per_step_us, per_beat_us, beat_wall_us = reporter_cost_us()
    poll_us = {world: poll_cost_us(world) for world in (2, 256)}
    ratios = []
    on_times = []
    for i in range(rounds):
        times = {}
        for enabled in (True, False) if i % 2 == 0 else (False, True):
            name = f"cost{i}-{'on' if enabled else 'off'}"
            knobs = sets(
                f"train.steps={steps}", "train.log_every=10", f"watchdog.enabled={str(enabled).lower()}"
            )
            cli("train", str(TINY), *common(work, data, name), *knobs, cwd=work)
            times[enabled] = median_step_s(work / "runs" / name)
        ratios.append(times[True] / times[False])
        on_times.append(times[True])
        print(
            f"  pair {i + 1}: step {times[True] * 1000:.1f} ms on, {times[False] * 1000:.1f} ms off: ratio {ratios[-1]:.4f}"
        )
    step = statistics.median(on_times)
    beat_share = per_beat_us / 1e6  # one write a second
    poll_share = poll_us[2] / (2.0 * 1e6)  # one poll every poll_s = 2 s
    total = per_step_us / 1e6 / step + beat_share + poll_share
    print(f"(a) by parts, against the tiny model's {step * 1000:.1f} ms step:")
    print(f"    progress calls in the loop: {per_step_us:.2f} us per step = {per_step_us / 1e6 / step:.4%}")
    print(
        f"    heartbeat write (1/s, per rank): {per_beat_us:.0f} us of CPU = {beat_share:.4%} of each second "
        f"({beat_wall_us:.0f} us wall, waiting for the filesystem in the heartbeat thread)"
    )
    print(
        f"    watchdog poll (every 2 s, node 0's agent): {poll_us[2]:.0f} us of CPU for 2 ranks = "
        f"{poll_share:.4%}; {poll_us[256]:.0f} us for 256 ranks"
    )
    print(f"    total: {total:.3%} of step time (goal: under 0.5 %)")
    print(
        f"(b) end to end, watchdog on / off: median ratio {statistics.median(ratios):.4f} over {rounds} pairs "
        f"(pairs {min(ratios):.3f} .. {max(ratios):.3f})"
    )


# ---- 2. a hang ---------------------------------------------------------------------------------


def metric_lines(run: Path) -> int:
    try:
        return (run / "metrics.jsonl").read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def hang(work: Path, data: Path, hang_at: int, step_min_s: int | None, steps: int = 60) -> None:
    name = "hang"
    run = work / "runs" / name
    knobs = [
        f"train.steps={steps}",
        "train.log_every=1",
        f"checkpoint.every_steps={max(1, steps // 3)}",
        f"testing.hang=[{{rank: 1, phase: data, step: {hang_at}}}]",
    ]
    if step_min_s is not None:
        knobs.append(f"watchdog.step_min_s={step_min_s}")
    cli("submit", str(TINY), "--no-preflight", *common(work, data, name), *sets(*knobs), cwd=work)
    requeued = first_step_at = None
    lines_before = 0
    while first_step_at is None:
        if requeued is None:
            story = events(run)
            requeued = next((e for e in story if e["event"] == "requeued"), None)
            if any(e["event"] in ("failed", "finished") for e in story):
                raise SystemExit("the run ended without the hang being continued")
            lines_before = metric_lines(run)
        elif metric_lines(run) > lines_before:  # the continuation's first step (log_every=1)
            first_step_at = time.time()
        time.sleep(0.05)
    story = events(run)
    verdict = next(e for e in story if e["event"] == "hang")
    # (rank 1's last heartbeat, as its node's agent aggregated it: ``rundir.progress_files.read_progress``)
    report = read_progress(RunPaths(run), verdict["attempt"])[1]
    started = [e for e in story if e["event"] == "started"][1]
    resumed = [e for e in story if e["event"] == "resumed"][1]
    stopped_at = report.phase_since
    parts = [
        (
            "detection (rank stops -> verdict)",
            verdict["detected_at"] - stopped_at,
            f"window {verdict['window_s']:.0f} s",
        ),
        ("dump (every rank's stacks)", verdict["dump_s"], ""),
        ("teardown (kill, rank host exits, decision)", requeued["ts"] - verdict["ts"], ""),
        ("restart: next attempt's process", started["ts"] - requeued["ts"], ""),
        (
            "restart: start-up + checkpoint load",
            resumed["ts"] - started["ts"],
            f"resumed at step {resumed['step']}",
        ),
        ("restart: first step", first_step_at - resumed["ts"], ""),
    ]
    print(f"hang of rank 1 at step {hang_at}: {verdict['reason']}")
    for label, seconds, note in parts:
        print(f"  {label:44s} {seconds:7.2f} s  {note}")
    print(f"  {'total: hang -> the continuation first step':44s} {first_step_at - stopped_at:7.2f} s")
    status = json.loads(cli("status", str(run), "--json", cwd=work))
    while status["state"] not in ("finished", "failed", "lost"):
        time.sleep(1)
        status = json.loads(cli("status", str(run), "--json", cwd=work))
    print(f"  run {status['state']}; attempts: {[(a['end'], a['cause']) for a in status['attempts']]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="on/off pairs for the end-to-end cost")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--hang-at", type=int, default=30)
    parser.add_argument("--step-min-s", type=int, default=None, help="watchdog.step_min_s (default: 60)")
    parser.add_argument("--skip-cost", action="store_true")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="the smallest sizes, in seconds: that it runs (make test), no figures",
    )
    args = parser.parse_args()
    if args.smoke:
        args.rounds, args.steps, args.hang_at, args.step_min_s = 1, 25, 6, 5
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        data = work / "data"
        cli("data", "synth", str(data), "--samples", "1024", cwd=work)
        if not args.skip_cost:
            cost(work, data, args.rounds, args.steps)
        hang(work, data, args.hang_at, args.step_min_s, 24 if args.smoke else 60)


if __name__ == "__main__":
    main()
