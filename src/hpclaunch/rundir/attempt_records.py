"""The records one attempt's processes pass to each other, as JSON: the agent's request to its rank
host (its stdin) and the answer (marked lines of its stderr), the node's report, the roster (files in the attempt's directory).

Typed here, below both sides: the rank host's code is the rank package's (``rank/host.py``), which
imports nothing of ``jobs``, and the agent's is ``jobs``. Plain dicts at run
time (TypedDicts), so what goes over the pipe and into the files is exactly what it was.
"""

from __future__ import annotations

from typing import TypedDict


class RosterJSON(TypedDict):
    """``jobs.allocation.Roster.to_json()``: the training nodes in rank order, then the spares."""

    training: list[str]
    spares: list[str]


class _RankRequired(TypedDict):
    run_id: str  # the attempt
    nnodes: int
    nproc: int
    run_dir: str
    log_dir: str  # the elastic launcher's logs of this node
    env: dict[str, str]  # the attempt's variables for every rank


class RankRequest(_RankRequired, total=False):
    """This node's part of an attempt (``jobs.attempt_env.rank_request``); several nodes also name
    the rendezvous."""

    rdzv_endpoint: str
    rdzv_configs: dict[str, bool | int]  # is_host, join_timeout
    local_addr: str | None
    program: str  # what each rank runs: "mmdit" (the built-in trainer, the default) or "script"


class AttemptEnd(TypedDict, total=False):
    """How this node's part of an attempt ended: the rank host's answer, and (with ``host``) the
    node's report ``node<N>.done.json`` that the decider reads."""

    state: str  # succeeded | failed | lost (the rank host died) | spare (this node trained nothing)
    returncode: int
    seconds: float
    failures: dict[str, int]  # rank -> exit code (negative: killed by that signal)
    error: str
    stopped_by_agent: bool  # the agent stopped these ranks: another node ended the attempt
    host: str  # the report's node


class HostReady(TypedDict):
    """The rank host runs its forkserver (the trainer is being imported into it)."""

    pid: int
    forkserver: int


# How the rank host's replies stand out in its stderr (its own reports and torch's logs go there
# too): a line holding this mark, then the reply's JSON. Stderr, not a pipe of their own, because
# every container runtime carries a process's stderr, where not every one passes another
# descriptor (srun's steps for pyxis pass none, podman only from 3 on, each named).
REPLY_MARK = "\x1ehpclaunch-rank-host "
REPLY_MAX_BYTES = 4000  # one write() of at most PIPE_BUF (4096) bytes is never split by another's


class HostReply(TypedDict, total=False):
    """One line from the rank host: ready once, then one ``done`` per attempt."""

    ready: HostReady
    done: AttemptEnd
