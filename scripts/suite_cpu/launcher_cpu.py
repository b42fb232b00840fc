"""The CPU of one launch of the trainer's integration tests (2 ranks, 60 steps of the tests' small
run): a plain torchrun (every rank its own interpreter) against ``preloaded_torchrun.py`` (the ranks
forked from one interpreter that imported the trainer once), alternated, each launch in its own
cpuacct cgroup so that every process it starts is counted. docs/figures.md quotes it.

    .venv/bin/python scripts/suite_cpu/launcher_cpu.py [PAIRS]      (root: the cgroup; default 3)

Prints each launch's core-seconds and wall, whether every launch ended with the same parameters,
and the ratio of the medians (preloaded / plain)."""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "integration" / "helpers"))
import trainer_helpers as h  # noqa: E402

CGROUP = Path("/sys/fs/cgroup/cpuacct/hpclaunch-launcher-cpu")


def launch(root: Path, data: Path, name: str, plain: bool) -> tuple[float, float, str]:
    """(core-s, wall s, params hash) of one launch."""
    run = h.make_run(root, name, data)
    argv = h.command(run, 2, plain_torchrun=plain)
    before = int((CGROUP / "cpuacct.usage").read_text())
    began = time.monotonic()
    proc = subprocess.run(
        ["sh", "-c", f'echo $$ > {CGROUP}/tasks && exec "$@"', "sh", *argv],
        env=h.env_for("a1"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    wall = time.monotonic() - began
    time.sleep(1.0)  # (what the launch left to exit, a writer or a forkserver, is counted too)
    core_s = (int((CGROUP / "cpuacct.usage").read_text()) - before) / 1e9
    if proc.returncode != 0:
        raise SystemExit(f"launch {name} exited {proc.returncode}: {proc.stderr[-2000:]}")
    return core_s, wall, str(h.outcome(run)["params_sha256"])


def main(pairs: int) -> None:
    CGROUP.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="launcher-cpu-") as tmp:
        root = Path(tmp)
        data = h.make_data(root)
        rows: dict[bool, list[tuple[float, float, str]]] = {True: [], False: []}
        for i in range(pairs):
            for plain in (True, False):
                rows[plain].append(launch(root, data, f"r{i}-{'plain' if plain else 'preloaded'}", plain))
    for plain, label in ((True, "plain torchrun"), (False, "preloaded     ")):
        print(label, "  ".join(f"{c:.2f} core-s / {w:.1f} s" for c, w, _ in rows[plain]))
    print("same parameters after every launch:", len({r[2] for rs in rows.values() for r in rs}) == 1)
    plain_s = statistics.median(c for c, _, _ in rows[True])
    pre_s = statistics.median(c for c, _, _ in rows[False])
    print(
        f"median core-s: plain {plain_s:.2f}, preloaded {pre_s:.2f}: ratio preloaded/plain {pre_s / plain_s:.2f}"
    )


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
