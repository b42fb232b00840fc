"""The ``node`` check (node checks only): an admin's "keep hpclaunch off this node" marker."""

from __future__ import annotations

from pathlib import Path

from .check_context import CheckContext, Outcome, skip
from .results import Status

MARKER_DIR_VAR = "HPCLAUNCH_NODE_MARKER_DIR"
DEFAULT_MARKER_DIR = "/etc/hpclaunch"


def marker_paths(ctx: CheckContext) -> list[Path]:
    base = Path(ctx.environ.get(MARKER_DIR_VAR) or DEFAULT_MARKER_DIR)
    names = []
    if ctx.node is not None:
        names.append(ctx.node.hostname)
    names.append(ctx.hostname.split(".")[0])
    return [base / f"unhealthy-{n}" for n in dict.fromkeys(names)]


def check_node(ctx: CheckContext) -> Outcome:
    """Fail when the marker file ``<dir>/unhealthy-<hostname>`` exists on this node.

    ``<dir>`` is ``$HPCLAUNCH_NODE_MARKER_DIR``, else ``/etc/hpclaunch``; ``<hostname>`` is the
    node's name as the scheduler knows it (``SLURMD_NODENAME`` / the PBS node file), and also the
    machine's short hostname. The file's first line, if any, is shown as the reason.

    Admins use it to keep runs off a node without draining it for everybody (on SLURM the job is
    requeued excluding the node); tests use it as the hook that makes one node of the local
    two-node cluster fail its checks.
    """
    for path in marker_paths(ctx):
        try:
            text = path.read_text().strip()
        except FileNotFoundError:
            continue
        except OSError as e:
            text = f"(unreadable: {e.strerror})"
        reason = text.splitlines()[0][:200] if text else "no reason given"
        return Outcome(
            Status.FAIL,
            f"marked unhealthy by {path}: {reason}",
            f"remove {path} once the node is fixed",
        )
    if ctx.node is None:
        return skip("node markers are checked on each allocated node")
    return Outcome(Status.PASS, f"no marker {marker_paths(ctx)[0]}")
