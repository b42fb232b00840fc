"""The rank host's forkserver is a fork of the rank host (``rank.forkserver_fork``): its children
have what the host imported, they do not hold the host's own descriptors, it leaves with the host,
and a host that runs a thread starts nothing that way (the caller then starts the standard one).

Each case runs in a process of its own: the forkserver is per process, and pytest's has threads."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import psutil
from tests.runlib import process_running, start_script, wait_for

HOST = r"""
import json, multiprocessing, os, sys, threading
from multiprocessing import forkserver

MARK = os.getpid()  # a forked forkserver's children see the host's value; a spawned one's, its own


def child(conn, fd, ino):
    try:
        holds = os.fstat(fd).st_ino == ino  # (the number may be reused for another file)
    except OSError:
        holds = False
    conn.send({"mark": sys.modules["__main__"].MARK, "ppid": os.getppid(), "holds_fd": holds})


if __name__ == "__main__":
    from hpclaunch.rank import forkserver_fork

    if sys.argv[1] == "thread":
        stop = threading.Event()
        threading.Thread(target=stop.wait, daemon=True).start()
        started = forkserver_fork.start()
        print(json.dumps({"started": started, "pid": forkserver._forkserver._forkserver_pid}))
        stop.set()
        sys.exit(0)
    r, w = os.pipe()
    started = forkserver_fork.start(keep_fds=(w,))
    ctx = multiprocessing.get_context("forkserver")
    ours, theirs = ctx.Pipe()
    p = ctx.Process(target=child, args=(theirs, w, os.fstat(w).st_ino))
    p.start()
    got = ours.recv()
    p.join()
    print(json.dumps({"started": started, "host": os.getpid(),
                      "server": forkserver._forkserver._forkserver_pid, "exitcode": p.exitcode, **got}),
          flush=True)
    sys.stdin.read()  # stays until the test closes its stdin
"""


def _host(tmp_path: Path, how: str) -> subprocess.Popen[str]:
    return start_script(tmp_path / "host.py", HOST, how)


def test_the_forkserver_is_a_fork_of_the_host_and_its_children_have_the_hosts_state(tmp_path: Path) -> None:
    host = _host(tmp_path, "fork")
    assert host.stdout is not None and host.stdin is not None
    got = json.loads(host.stdout.readline())
    assert got["started"] is True
    assert psutil.Process(got["server"]).ppid() == got["host"]  # forked from the host itself
    assert got["ppid"] == got["server"] and got["exitcode"] == 0  # children come from it
    assert got["mark"] == got["host"]  # the host's module state, not a re-import
    assert got["holds_fd"] is False  # the descriptors the host keeps to itself are closed there
    host.stdin.close()  # the host leaves, and its forkserver after it (its "alive" pipe's end)
    assert host.wait(timeout=60) == 0
    wait_for(
        lambda: not process_running(got["server"]), timeout=60, poll=0.05, what="the forkserver to leave"
    )


def test_a_host_running_a_thread_forks_no_forkserver(tmp_path: Path) -> None:
    host = _host(tmp_path, "thread")
    out, _ = host.communicate(timeout=60)
    assert json.loads(out) == {"started": False, "pid": None}
