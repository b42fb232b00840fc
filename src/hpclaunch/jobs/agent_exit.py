"""How a node agent that cannot go on leaves: what it records, and whether that ends the run.

An error that is the run's own (its config, its sweep point, the scheduler refusing what the run
asked) ends the run, said by the agent that decides (``FAILED``, and the runs chained after it are
settled). Any other agent, and any error that is not the run's (a filesystem error that outlasted
its retries), ends this agent only: it records ``agent_error`` (the words, and the errno's name
where there is one) and exits; the role moves to the next live agent, and the rescue, when this
agent's death ended the job, reads the record: the batch host's software failed, not its node.
"""

from __future__ import annotations

import contextlib
import errno
import sys

from ..errors import HpclaunchError
from ..rundir import FAILED, Ledger, RunPaths
from ..rundir.cause import Cause
from ..rundir.kinds import AGENT_ERROR
from .chain_end import after_attempt


def words(error: BaseException) -> str:
    """One line for the ledger and the log: an OSError names its errno (ESTALE, EIO) and path."""
    if isinstance(error, HpclaunchError):
        return error.one_line()
    if isinstance(error, OSError) and error.errno is not None:
        name = errno.errorcode.get(error.errno, str(error.errno))
        where = f": {error.filename}" if error.filename else ""
        return f"filesystem error {name} ({error.strerror}){where}"
    return str(error)


def agent_failed(
    paths: RunPaths, node: int, error: BaseException, *, decides: bool | None, attempt: str | None = None
) -> int:
    """Record why this agent leaves (see the module docstring); its exit code. ``decides``: whether
    this agent held the decider's role when it failed (None: it failed before it had one, where
    node 0's agent is the one that decides)."""
    line = words(error)
    ends_run = (decides if decides is not None else node == 0) and isinstance(error, HpclaunchError)
    with contextlib.suppress(OSError):  # the filesystem that failed may fail this record too
        ledger = Ledger(paths, role="agent", attempt=attempt, node=node)
        if ends_run:
            ledger.append(FAILED, cause=Cause.CRASH, error=line, reason=line)
        else:
            fields = {"errno": errno.errorcode.get(error.errno or 0)} if isinstance(error, OSError) else {}
            ledger.append(AGENT_ERROR, error=line, **fields)
    if ends_run:
        after_attempt(paths)
    print(f"hpclaunch: agent error: {line}", file=sys.stderr, flush=True)
    return 1
