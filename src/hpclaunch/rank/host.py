"""The rank host: one per node for the whole allocation (``python -m hpclaunch.rank.host``),
started and driven by the node agent.

Every attempt used to pay a whole process start-up: torchrun importing torch, then every rank
importing torch, mmdit and DCP (2.5-4 s of a 6 s restart on this project's machine). The rank host
pays it once: it imports what the ranks run when the allocation starts (``HPCLAUNCH_PRELOAD``: the
built-in trainer's modules, or torch, DCP and the rank package plus ``script.preload`` for a
script) and forks ``multiprocessing``'s forkserver from itself (``forkserver_fork``; where that
cannot be done, a forkserver that imports them itself), and each attempt's ranks are forked from
it in milliseconds. Each rank runs the request's program: the MMDiT trainer's entry point, or a
user's script as ``__main__`` (``script_main``). An
attempt is one round of torch's own elastic launcher (``elastic_launch``: the
``LocalElasticAgent`` spawns, watches and tears down the ranks, c10d rendezvous with a fresh run id
per attempt, ``max_restarts=0``): whether an attempt is followed by another, and on which nodes, is
the node agent's decision (``jobs.decision_rules``), never a restart counter's.

Protocol: the agent writes one JSON request per line on stdin (``{"attempt": {...}}`` or
``{"exit": true}``); replies are marked lines on stderr (``rundir.attempt_records.REPLY_MARK``:
``{"ready": ...}`` once the forkserver runs, ``{"done": ...}`` after each attempt), since every
container runtime carries stdin, stdout and stderr and not every one another descriptor. The ranks'
output and the launcher's own go to stdout and stderr, which the agent writes into the attempt's
node log.

Scheduler signals are ignored here (the agent starts this process with USR1/USR2/TERM/INT ignored,
and it ignores them itself first thing, since a container runtime between the two may not pass the
dispositions on; the forkserver and the ranks inherit that, the ranks then install their own
handlers): a preemption's SIGTERM reaches the ranks through the agent's relay, never kills the host
mid-save.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import sys
import time
from multiprocessing import forkserver
from pathlib import Path
from typing import Any

from ..rundir.attempt_records import REPLY_MARK, REPLY_MAX_BYTES, AttemptEnd, RankRequest
from ..rundir.env import PRELOAD_COMPILE_VAR, PRELOAD_VAR
from ..rundir.node_dir import write_seen
from .helper_signals import ignore_stop_signals

# What the ranks run, by the request's ``program``: entry points named, not imported (the rank
# package sits below the trainer; the trainer is imported into the forkserver by name).
PROGRAMS = {"mmdit": "hpclaunch.trainer.entry", "script": "hpclaunch.rank.script_main"}
# Imported once, forked after: the built-in trainer's (torch, mmdit, DCP and the trainer) unless the
# agent names others (a script's run: the rank package and the script's own ``script.preload``).
PRELOAD = [m for m in os.environ.get(PRELOAD_VAR, "hpclaunch.trainer.setup.preload").split(",") if m]
if os.environ.get(PRELOAD_COMPILE_VAR):  # train.compile: Dynamo's and inductor's compilers too
    PRELOAD.append("hpclaunch.trainer.setup.preload_compile")


# A rank whose work has ended (its outcome written) leaves its process within this long, whatever
# the process still waits for at exit.
EXIT_GRACE_S = 60.0


def rank_main(run_dir: str, env: dict[str, str], program: str = "mmdit") -> int:
    """One rank of one attempt (runs in a process forked from the forkserver)."""
    import importlib

    os.environ.update(env)  # the attempt's variables: the forkserver's environment is the allocation's
    main = importlib.import_module(PROGRAMS[program]).main
    code = 1  # (what an exception out of main leaves)
    try:
        code = main([run_dir], leave_at_once_on_failure=True)
    except SystemExit as e:  # (a stop's own exit code is kept, should the exit need cutting short)
        code = e.code if isinstance(e.code, int) else 1
        raise
    finally:
        exit_within(EXIT_GRACE_S, code)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    if code:
        raise SystemExit(code)  # the elastic agent sees a failed rank
    return 0


def exit_within(grace_s: float, code: int) -> None:
    """Past this point the process must end: after ``grace_s`` a daemon thread ends it with
    ``code``. A forked rank ends through multiprocessing's exit function, which terminates and joins
    every child the rank left (a DataLoader's workers, which ignore SIGTERM, held a failed rank for
    25 minutes on CI) and the watchdog's window for the final teardown is the checkpoint's; the
    rank's outcome is written by now, so what is cut is only a wait."""
    import threading

    def leave() -> None:
        time.sleep(grace_s)
        with contextlib.suppress(OSError, ValueError):
            print(
                f"hpclaunch: rank process {os.getpid()} ended its work {grace_s:g} s ago and had not "
                "exited (something it started was still running): it exits now",
                file=sys.stderr,
                flush=True,
            )
        os._exit(code)

    threading.Thread(target=leave, name="hpclaunch-exit-within", daemon=True).start()


def run_attempt(request: RankRequest) -> AttemptEnd:
    """One elastic round: rendezvous, fork the ranks, wait for all of them."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    log_dir = Path(request["log_dir"])
    log_dir.mkdir(parents=True, exist_ok=True)
    config = LaunchConfig(
        min_nodes=request["nnodes"],
        max_nodes=request["nnodes"],
        nproc_per_node=request["nproc"],
        run_id=request["run_id"],
        role="trainer",
        # One node: c10d on a free local port, as torchrun --standalone does.
        rdzv_endpoint=request.get("rdzv_endpoint") or "127.0.0.1:0",
        rdzv_backend="c10d",
        rdzv_configs=request.get("rdzv_configs") or {"is_host": True},
        max_restarts=0,
        monitor_interval=0.1,
        start_method="forkserver",
        signals_to_handle="SIGHUP,SIGQUIT",
        local_addr=request.get("local_addr"),
        logs_specs=DefaultLogsSpecs(log_dir=str(log_dir)),
    )
    began = time.time()
    try:
        elastic_launch(config, rank_main)(request["run_dir"], request["env"], request.get("program", "mmdit"))
        return {"state": "succeeded", "returncode": 0, "seconds": round(time.time() - began, 3)}
    except ChildFailedError as e:
        codes = {str(rank): f.exitcode for rank, f in e.failures.items()}
        # The rank host's own report: in the node log (a foreground run keeps it off the terminal).
        print(
            f"hpclaunch rank host: {request['run_id']}: ChildFailedError: exit codes by rank {codes}",
            file=sys.stderr,
            flush=True,
        )
        return {
            "state": "failed",
            "returncode": 1,
            "failures": codes,
            "seconds": round(time.time() - began, 3),
        }
    except Exception as e:  # rendezvous timeout, a store that went away: the attempt failed
        return {"state": "failed", "returncode": 1, "error": f"{type(e).__name__}: {e}"}


def _fork_forkserver() -> bool:
    """Import PRELOAD here and fork the forkserver from this process (``forkserver_fork``): one
    import of torch per node instead of two. False: start it the standard way."""
    import importlib

    from . import forkserver_fork

    if not forkserver_fork.supported():
        return False
    try:
        for name in PRELOAD:
            importlib.import_module(name)
    except ImportError:
        return False  # (the standard forkserver skips it; the ranks then say what is missing)
    return forkserver_fork.start()


def send(**message: Any) -> None:
    """One reply to the agent: one marked line, written whole in one call (``REPLY_MAX_BYTES``)."""
    line = json.dumps(message)
    if len(line) > REPLY_MAX_BYTES and "done" in message:  # only an error text can be that long
        done = dict(message["done"])
        done["error"] = str(done.get("error", ""))[: REPLY_MAX_BYTES // 2]
        line = json.dumps({"done": done})
    os.write(2, f"{REPLY_MARK}{line}\n".encode())


def serve() -> int:
    ignore_stop_signals()
    multiprocessing.set_forkserver_preload(PRELOAD)
    if not _fork_forkserver():
        forkserver.ensure_running()  # a new interpreter that imports PRELOAD meanwhile
    # torch's log formatter imports torch._dynamo the first time it formats an exception, which the
    # elastic agent does when a rank fails: 1.5 s between a crash and the decision, unless done now.
    import torch._dynamo.config
    import torch.distributed.launcher.api  # noqa: F401  (the elastic launcher, imported before the first attempt)

    # What this host and its agent share on the node (the ranks' heartbeats): proved before the
    # first attempt, written here in the image and read by the agent outside (``rundir.node_dir``).
    unseen = write_seen()
    if unseen is not None:
        print(f"hpclaunch rank host: the node directory: {unseen}", file=sys.stderr, flush=True)
    send(ready={"pid": os.getpid(), "forkserver": forkserver._forkserver._forkserver_pid})  # type: ignore[attr-defined]
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        if request.get("exit"):
            break
        send(done=run_attempt(request["attempt"]))
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 1:
        print(
            "usage: python -m hpclaunch.rank.host  (requests on stdin, replies on stderr)",
            file=sys.stderr,
        )
        sys.exit(2)
    sys.exit(serve())
