"""Starting this node's rank host for the node agent, and whether it shares the agent's node
directory: the rank host proves it at its start by writing a token there (in an image: through the
runtime's mount), which the agent reads here; failing that, the ranks report in the run directory."""

from __future__ import annotations

import os
import sys
import uuid

from ..rundir import NODE_PREFLIGHT
from ..rundir.env import FOREGROUND_VAR  # `hpclaunch train`: keep the launcher's report off the terminal
from ..rundir.node_dir import NodeDir, consume_seen
from .attempt_env import rank_host_command, rank_host_environment
from .node_run import NodeRun
from .rank_host import LogSink, RankHost

__all__ = ["shared_node_dir", "start_rank_host"]


def start_rank_host(node: NodeRun, node_dir: NodeDir | None, sink: LogSink) -> RankHost:
    """This node's rank host, started with the plan's command and a fresh proof token."""
    quiet = os.environ.get(FOREGROUND_VAR) == "1"
    token = uuid.uuid4().hex
    env = rank_host_environment(node, node_dir, token)
    argv, env = rank_host_command(node.plan, node.ctx, node.paths, env, node_dir)
    host = RankHost(argv, env, node.paths.root, sink, echo_stderr=not quiet)
    host.token = token
    return host


def shared_node_dir(node: NodeRun, host: RankHost, node_dir: NodeDir | None) -> NodeDir | None:
    """The node directory when ``host`` shares it with this agent (it proved it at its start), else
    None: the ranks then report in the run directory, said once per rank host."""
    if node_dir is None:
        return None
    if host.node_dir_seen is None:
        host.node_dir_seen = consume_seen(node_dir.path, host.token)
        if not host.node_dir_seen:
            why = (
                f"the ranks in the image do not see this node's directory {node_dir.path} at "
                f"{node_dir.ranks_path} (container.flags or the runtime's mounts hide it): their "
                "heartbeats go to the run directory instead"
            )
            print(f"hpclaunch: node {node.ctx.hostname}: {why}", file=sys.stderr, flush=True)
            node.ledger.append(
                NODE_PREFLIGHT, ok=True, checks=[{"name": "node_dir", "status": "warn", "finding": why}]
            )
    return node_dir if host.node_dir_seen else None
