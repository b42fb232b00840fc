"""A rank's first checkpoint writer is forked before the rank's first thread
(``writer_process.prefork``) and waits for its spec: it dies with its rank (``kill -9`` included),
a rank done without a background save lets it go and reaps it, and a rank that runs a thread forks
none (its first save starts one). The forked writer at work: tests/integration
(test_checkpoint_writer_torchrun.py, "writer_forked").

Each case runs in a process of its own (pytest's has threads)."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import psutil
from tests.runlib import process_running, start_script, wait_for

RANK = r"""
import json, os, sys, threading
from hpclaunch.rank.checkpoint import writer_process as wp

if sys.argv[1] == "thread":
    threading.Thread(target=threading.Event().wait, daemon=True).start()
forked = wp.prefork()
pid = wp._waiting.child.pid if forked else None
print(json.dumps({"forked": forked, "writer": pid}), flush=True)
if sys.argv[1] == "discard":
    child = wp._waiting.child
    wp.discard_waiting()
    print(json.dumps({"code": child.returncode, "left": wp._waiting is not None}), flush=True)
else:
    sys.stdin.read()
"""


def _rank(tmp_path: Path, how: str) -> subprocess.Popen[str]:
    return start_script(tmp_path / "rank.py", RANK, how)


def test_a_forked_writer_dies_with_its_rank_killed_with_sigkill(tmp_path: Path) -> None:
    rank = _rank(tmp_path, "kill")
    assert rank.stdout is not None
    got = json.loads(rank.stdout.readline())
    assert got["forked"] is True and psutil.Process(got["writer"]).ppid() == rank.pid
    assert process_running(got["writer"])  # it waits for its first save
    rank.send_signal(signal.SIGKILL)
    rank.wait(timeout=60)
    wait_for(lambda: not process_running(got["writer"]), timeout=60, poll=0.05, what="the writer to die")


def test_a_rank_done_without_a_background_save_reaps_its_forked_writer(tmp_path: Path) -> None:
    rank = _rank(tmp_path, "discard")
    out, _ = rank.communicate(timeout=60)
    first, second = (json.loads(line) for line in out.splitlines())
    assert first["forked"] is True
    assert second == {"code": 0, "left": False}  # it left when its channel closed; reaped
    assert not psutil.pid_exists(first["writer"]) or not process_running(first["writer"])


def test_a_rank_running_a_thread_forks_no_writer(tmp_path: Path) -> None:
    rank = _rank(tmp_path, "thread")
    out, _ = rank.communicate(input="", timeout=60)
    assert json.loads(out.splitlines()[0]) == {"forked": False, "writer": None}
