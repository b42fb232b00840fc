"""Preflight's look at a user's script: run it, as one rank alone, as far as its
``hpclaunch.attach`` and no further (``probe_main`` calls ``probe`` in the job's Python).

At attach the run tells what it would save (one rank's state: the model, the optimizer with its
state made, the other objects) and how long the script took to get there; it then leaves with
``ProbeDone`` before anything is restored, written or trained. The script sees a one-rank
torchrun environment (RANK 0 of 1, a free local MASTER_PORT), so a script written for torchrun
joins its process group as usual.
"""

from __future__ import annotations

import os
import runpy
import socket
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["PROBE_VAR", "ProbeDone", "probe"]

PROBE_VAR = "HPCLAUNCH_SCRIPT_PROBE"  # set: attach reports and leaves (``ProbeDone``)


class ProbeDone(SystemExit):
    """Raised by ``attach`` in a probe: what it saw. A ``SystemExit``, so that a script's own
    ``except Exception`` does not swallow it."""

    def __init__(self, measure: dict[str, Any]) -> None:
        super().__init__(0)
        self.measure = measure


def probe(request: Any) -> dict[str, Any]:
    path = Path(str(request["path"]))
    if not path.is_file():
        return {"error": f"{path} is not a file"}
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
           "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}  # fmt: skip
    os.environ.update(env)
    os.environ[PROBE_VAR] = "1"
    os.environ.pop("HPCLAUNCH_RUN_DIR", None)  # (never a run's: a probe writes nothing)
    if request.get("workdir"):
        os.chdir(str(request["workdir"]))
    sys.argv = [str(path), *[str(a) for a in request.get("args") or []]]
    sys.path.insert(0, str(path.parent))
    began = time.monotonic()
    try:
        runpy.run_path(str(path), run_name="__main__")
    except ProbeDone as done:
        return {**done.measure, "attach_s": round(time.monotonic() - began, 3)}
    except SystemExit as e:
        return {"error": f"the script exited with code {e.code} before it called hpclaunch.attach()"}
    return {"error": "the script ended without calling hpclaunch.attach()"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
