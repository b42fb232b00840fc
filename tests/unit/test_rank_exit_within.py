"""A rank whose work has ended leaves its process (``rank.host.exit_within``): a forked rank ends
through multiprocessing's exit function, which joins whatever children the rank left, and a child
that never ends held a failed rank for 25 minutes on CI (its DataLoader's workers, which ignore
SIGTERM). Here the child is a process that sleeps; the rank's process still ends, with its code."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = r"""
import multiprocessing, sys, time
from hpclaunch.rank.helper_signals import die_with_parent
from hpclaunch.rank.host import exit_within


def lingers():
    die_with_parent()  # (gone with the rank's process: no orphan)
    time.sleep(600)


def rank(grace):
    multiprocessing.get_context("fork").Process(target=lingers).start()  # joined at exit: for ever
    if grace is not None:
        exit_within(grace, 3)


if __name__ == "__main__":
    grace = float(sys.argv[1]) if sys.argv[1] != "none" else None
    child = multiprocessing.get_context("fork").Process(target=rank, args=(grace,))
    child.start()
    child.join(None if grace is not None else 5)
    print("exitcode", child.exitcode, flush=True)
    if child.exitcode is None:
        child.kill()
"""


@pytest.mark.spawns
@pytest.mark.parametrize("grace", ["0.5", "none"])
def test_a_rank_process_that_ended_its_work_exits_whatever_it_left_running(
    tmp_path: Path, grace: str
) -> None:
    script = tmp_path / "rank.py"
    script.write_text(SCRIPT)
    done = subprocess.run([sys.executable, str(script), grace], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    if grace == "none":  # without the guard the process is still waiting (what CI saw)
        assert "exitcode None" in done.stdout, done.stdout
    else:
        assert "exitcode 3" in done.stdout, done.stdout + done.stderr[-2000:]
        assert "ended its work 0.5 s ago and had not exited" in done.stderr
