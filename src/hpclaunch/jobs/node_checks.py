"""Node checks before torchrun, and the start barrier through which node 0 hears every node's verdict.

Every node's agent runs the node checks (preflight's node, gpu, data, disk, network, fds: the
last raises the agent's soft ``ulimit -n``, which torchrun and the ranks inherit) and reports
its verdict in ``RUN/attempts/<attempt>/node<r>.json``. On a multi-node job, node 0 waits for all
verdicts, then writes ``go.json``: go, or stop with the reason; the other nodes wait for it before
they start torchrun. So one failing node never leaves the others waiting in a rendezvous until a
timeout, and only node 0 decides what happens next (exclude the node, fail the run), once.

A failing ``data`` check is a problem of the data when it fails on every node that checked it
(a corrupt shard looks the same from everywhere): the run fails naming the file. When it fails on
some nodes only (a missing mount), those nodes are the problem.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..config import RunConfig
from ..fsutil import atomic_write_json
from ..rundir import RunPaths
from ..schedulers.base import NodeContext

GATHER_TIMEOUT_S = 180.0  # how long node 0 waits for every node's verdict
POLL_S = 0.2


@dataclass(frozen=True)
class NodeVerdict:
    node_rank: int
    host: str
    ok: bool
    check: str | None = None  # the first failed check
    finding: str | None = None

    @property
    def data_only(self) -> bool:
        return not self.ok and self.check == "data"

    @classmethod
    def missing(cls, node_rank: int, host: str, waited_s: float) -> NodeVerdict:
        return cls(node_rank, host, False, "start", f"its agent reported nothing within {waited_s:.0f} s")


def run_checks(cfg: RunConfig, ctx: NodeContext) -> tuple[NodeVerdict, list[dict[str, str]]]:
    """This node's verdict and every check's (name, status, finding) for the ledger."""
    from ..preflight import NODE_CHECKS, run_node_checks
    from ..preflight.probe import StaticProbe

    if not cfg.preflight.node_checks:
        return NodeVerdict(ctx.node_rank, ctx.hostname, True), []
    # The env probe (a job-Python import of torch) costs seconds per attempt and torchrun would
    # fail just as clearly; the other checks are cheap and find broken nodes before rendezvous.
    # No probe at all: the disk check sizes checkpoints by formula and the GPU check counts GPUs
    # with nvidia-smi, instead of a torch import that cost 3-15 s of every restart (bench/restart_cost.py).
    no_probe = StaticProbe(error="not run on nodes (it imports torch)")
    report = run_node_checks(cfg, ctx, only=set(NODE_CHECKS) - {"env"}, probe=no_probe)
    rows = [{"name": c.name, "status": c.status.value, "finding": c.finding} for c in report.checks]
    failed = report.failed
    if not failed:
        return NodeVerdict(ctx.node_rank, ctx.hostname, True), rows
    first = failed[0]
    print(
        f"hpclaunch: node {ctx.hostname} failed check {first.name}: {first.finding}",
        file=sys.stderr,
        flush=True,
    )
    return NodeVerdict(ctx.node_rank, ctx.hostname, False, first.name, first.finding), rows


@dataclass(frozen=True)
class Verdicts:
    """Node 0's view of every node's checks."""

    nodes: list[NodeVerdict]

    @property
    def ok(self) -> bool:
        return all(v.ok for v in self.nodes)

    @property
    def data_error(self) -> str | None:
        """The data check failed on every node (and nothing else failed): the data is bad."""
        failed = [v for v in self.nodes if not v.ok]
        if failed and all(v.data_only for v in failed) and len(failed) == len(self.nodes):
            return failed[0].finding or "the data check failed"
        return None

    @property
    def failed_nodes(self) -> dict[str, str]:
        if self.data_error is not None:
            return {}
        return {v.host: f"failed check {v.check}: {v.finding}" for v in self.nodes if not v.ok}


class StartBarrier:
    """The files of one attempt's start: ``node<r>.json`` per node, ``go.json`` from node 0."""

    def __init__(self, paths: RunPaths, attempt: str, *, clock: Callable[[], float] = time.monotonic):
        self.dir = paths.attempt_dir(attempt)
        self.clock = clock

    def _node_file(self, rank: int) -> Path:
        return self.dir / f"node{rank}.json"

    def report(self, verdict: NodeVerdict) -> None:
        atomic_write_json(self._node_file(verdict.node_rank), asdict(verdict))

    def gather(self, ctx: NodeContext, *, timeout_s: float = GATHER_TIMEOUT_S) -> Verdicts:
        """Node 0: every node's verdict; a node silent for ``timeout_s`` counts as failed."""
        deadline = self.clock() + timeout_s
        found: dict[int, NodeVerdict] = {}
        while True:
            for rank in range(ctx.num_nodes):
                if rank not in found:
                    verdict = self._read(rank)
                    if verdict is not None:
                        found[rank] = verdict
            if len(found) == ctx.num_nodes or self.clock() >= deadline:
                break
            time.sleep(POLL_S)
        nodes = [
            found.get(r)
            or NodeVerdict.missing(r, ctx.hosts[r] if r < len(ctx.hosts) else f"node{r}", timeout_s)
            for r in range(ctx.num_nodes)
        ]
        return Verdicts(nodes)

    def announce(self, *, go: bool, reason: str = "", roster: dict[str, Any] | None = None) -> None:
        """Node 0's word to every node: go or not, and who trains (the roster) when it goes."""
        atomic_write_json(self.dir / "go.json", {"go": go, "reason": reason, "roster": roster})

    def wait_go(self, *, timeout_s: float) -> tuple[bool, str, dict[str, Any] | None]:
        """The other nodes: node 0's word; silence for ``timeout_s`` is a stop."""
        deadline = self.clock() + timeout_s
        while self.clock() < deadline:
            with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
                data = json.loads((self.dir / "go.json").read_text())
                return bool(data.get("go")), str(data.get("reason") or ""), data.get("roster")
            time.sleep(POLL_S)
        return False, f"node 0 gave no word within {timeout_s:.0f} s", None

    def _read(self, rank: int) -> NodeVerdict | None:
        try:
            data = json.loads(self._node_file(rank).read_text())
            return NodeVerdict(**data)
        except (FileNotFoundError, json.JSONDecodeError, TypeError):
            return None
