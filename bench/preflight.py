#!/usr/bin/env python3
"""What preflight's estimate adds to preflight: ``hpclaunch preflight examples/tiny.yaml`` with and
without ``--no-estimate``, alternating in the same run (paired runs see similar background load).

The estimate's training steps are timed in the probe that preflight starts before its checks, right
after the probe's own answer (issue 26: they used to run in a second process, with a second torch
import, after the checks). Printed: every run's wall time and the estimate's s/step, the medians,
and their ratio (goal <= 1.25), with the load average before and after.

The config is README's example, run from a temporary directory holding the data it reads
(``hpclaunch data synth data/tiny --config tiny.yaml``), so that every check can pass.

    .venv/bin/python bench/preflight.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "tiny.yaml"
SYNTH = ("--samples", "1024", "--config", "tiny.yaml")  # README's data step


def load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def preflight(cwd: Path, *extra: str) -> tuple[float, dict]:
    start = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "hpclaunch", "preflight", "tiny.yaml", "--json", *extra],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )
    wall = time.monotonic() - start
    if out.returncode != 0:
        sys.exit(f"preflight failed ({out.returncode}): {out.stderr.strip()[-500:]}")
    return wall, json.loads(out.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5, help="pairs of runs (default 5)")
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="the smallest sizes, in seconds: that it runs (make test), no figures",
    )
    args = ap.parse_args()
    if args.smoke:
        args.rounds = 1
    with tempfile.TemporaryDirectory(prefix="bench-preflight-") as d:
        cwd = Path(d)
        shutil.copy(TINY, cwd / "tiny.yaml")
        subprocess.run(
            [sys.executable, "-m", "hpclaunch", "data", "synth", "data/tiny", *SYNTH],
            cwd=cwd,
            check=True,
            capture_output=True,
        )
        print(f"load average before: {load()}  ({os.cpu_count()} cores)")
        if not args.smoke:
            preflight(cwd)  # warm the file cache once, not counted
        without, with_est = [], []
        for i in range(args.rounds):
            # alternate which goes first, so that neither always follows the other
            order = [("no-estimate", ("--no-estimate",)), ("estimate", ())]
            for name, extra in order if i % 2 == 0 else order[::-1]:
                wall, rep = preflight(cwd, *extra)
                est = rep.get("estimate")
                step = f"{est['seconds_per_step']:.3f} s/step" if est and "seconds_per_step" in est else ""
                print(f"round {i + 1} {name:12s} {wall:6.2f} s  (checks {rep['seconds']:.2f} s) {step}")
                (without if name == "no-estimate" else with_est).append(wall)
        m_without, m_with = statistics.median(without), statistics.median(with_est)
        print(f"load average after: {load()}")
        print(f"median preflight --no-estimate: {m_without:.2f} s")
        print(f"median preflight (estimate):    {m_with:.2f} s")
        print(f"ratio with / without: {m_with / m_without:.2f} (goal <= 1.25)")


if __name__ == "__main__":
    main()
