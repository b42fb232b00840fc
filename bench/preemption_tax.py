#!/usr/bin/env python3
"""What a stop costs: the same run uninterrupted vs stopped K times, on the local scheduler.

Both runs go through the real CLI (`hpclaunch submit`), same config and seed. The stopped run gets
`hpclaunch stop --continue` K times at evenly spaced steps: every rank saves, the attempt ends,
the local scheduler starts the next one, which resumes. Printed: wall time and steps of both,
seconds per stop, and lost/repeated steps from the ledger (must be 0), and whether the final
parameters are bitwise equal.

    python bench/preemption_tax.py [--stops 3] [--steps 240]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "tiny.yaml"


def cli(*args: str, cwd: Path) -> str:
    out = subprocess.run([sys.executable, "-m", "hpclaunch", *args], cwd=cwd, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"hpclaunch {' '.join(args)} failed:\n{out.stderr}")
    return out.stdout


def status(run: Path, cwd: Path) -> dict:
    return json.loads(cli("status", str(run), "--json", cwd=cwd))


def last_step(run: Path) -> int:
    path = run / "metrics.jsonl"
    if not path.exists():
        return 0
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return int(lines[-1]["step"]) if lines else 0


def params_sha(run: Path) -> str:
    for p in sorted((run / "attempts").glob("*.json"), key=lambda p: p.stat().st_mtime, reverse=True):
        data = json.loads(p.read_text())
        if data.get("status") == "finished":
            return str(data.get("params_sha256"))
    return "?"


def run_once(work: Path, data: Path, name: str, steps: int, stops: int) -> tuple[float, dict]:
    sets = [
        f"name={name}",
        f"run_dir={work / 'runs' / name}",
        f"train.steps={steps}",
        "train.log_every=1",
        f"data.token_dir={data / 'tokens'}",
        f"data.latent_dir={data / 'latents'}",
        "checkpoint.every_steps=1000000",
    ]
    args = ["submit", str(TINY), "--no-preflight"]
    for s in sets:
        args += ["--set", s]
    run = work / "runs" / name
    t0 = time.perf_counter()
    cli(*args, cwd=work)
    targets = [steps * (i + 1) // (stops + 1) for i in range(stops)]
    for target in targets:
        while last_step(run) < target:
            time.sleep(0.05)
        before = len(status(run, work)["attempts"])
        cli("stop", str(run), "--continue", cwd=work)
        while len(status(run, work)["attempts"]) <= before:  # the next attempt has started
            time.sleep(0.2)
    while True:
        s = status(run, work)
        if (
            s["state"] not in ("pending", "running", "requeued")
            and (s.get("scheduler") or {}).get("state") != "running"
        ):
            break
        time.sleep(0.5)
    return time.perf_counter() - t0, s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stops", type=int, default=3)
    parser.add_argument("--steps", type=int, default=240)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        data = work / "data"
        cli("data", "synth", str(data), "--samples", "1024", cwd=work)
        base_s, base = run_once(work, data, "uninterrupted", args.steps, 0)
        stop_s, stopped = run_once(work, data, "stopped", args.steps, args.stops)
        gp = stopped["goodput"]
        same = params_sha(work / "runs" / "uninterrupted") == params_sha(work / "runs" / "stopped")
        print(f"uninterrupted: {base_s:6.1f} s, {base['step']} steps, 1 attempt, state {base['state']}")
        print(
            f"stopped x{args.stops}:  {stop_s:6.1f} s, {stopped['step']} steps, {len(stopped['attempts'])} attempts, state {stopped['state']}"
        )
        print(
            f"seconds per stop (save + requeue + restart + resume): {(stop_s - base_s) / max(args.stops, 1):.1f}"
        )
        print(
            f"lost steps: {gp['lost_steps']}  repeated steps: {gp['repeated_steps']}  goodput: {gp['ratio']:.1%}"
        )
        print(f"final parameters bitwise equal: {same}")


if __name__ == "__main__":
    main()
