"""Node checks before every attempt, and the start barrier through which the decider hears every
node's verdict.

Before every attempt (the allocation's first, and each one restarted in place) every node the run
is using (training nodes and spares) runs the node checks (preflight's node, gpu, data, disk,
network, fds: the last raises the agent's soft ``ulimit -n``, which the rank host and the ranks
inherit) and reports its verdict in ``RUN/attempts/<attempt>/node<r>.json``. On a multi-node job the
decider waits for all verdicts, then writes ``go.json``: go (with the roster: a healthy spare in the
place of a node that failed), or stop with the reason; the other nodes wait for it before their
ranks start. So one failing node never leaves the others waiting in a rendezvous until a timeout,
a bad GPU is found between two attempts instead of crashing the next one, and only the decider
decides what happens next (replace the node, exclude it, fail the run), once. A waiting node
watches the decider's heartbeat: when the decider dies during the checks, the next live node
gathers the verdicts and announces instead (``wait_go``'s ``take_over``).

A failing ``data`` check is a problem of the data when it fails on every node that checked it
(a corrupt shard looks the same from everywhere): the run fails naming the file. When it fails on
some nodes only (a missing mount), those nodes are the problem.
"""

from __future__ import annotations

import errno
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

from ..config import RunConfig, TestingConfig
from ..fsutil import atomic_write_json, create_exclusive, poll_json, retry_patiently
from ..rundir import JobPlan, RunPaths
from ..rundir.attempt_records import RosterJSON
from ..rundir.events import CheckRow
from ..schedulers.protocol import NodeContext
from .allocation import START_GRACE_S

GATHER_TIMEOUT_S = START_GRACE_S  # how long the decider waits for every node's verdict (one window)
# How long one node's checks may take in all (HPCLAUNCH_NODE_CHECKS_S: tests make a stuck one short).
CHECKS_DEADLINE_S = float(os.environ.get("HPCLAUNCH_NODE_CHECKS_S") or 120.0)
T = TypeVar("T")
POLL_S = 0.2
LOOK_S = 1.0  # how often the gather looks at a silent node's heartbeat


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


def run_checks(
    plan: JobPlan, checked: RunConfig | None, ctx: NodeContext
) -> tuple[NodeVerdict, list[CheckRow]]:
    """This node's verdict and every check's (name, status, finding) for the ledger: preflight's
    node checks over ``checked``, the run's config (what it promises: its data, its disk, its GPUs),
    as ``hpclaunch preflight`` runs them on the login side; None: the plan turns them off."""
    from ..preflight import NODE_CHECKS, run_node_checks
    from ..preflight.probe import StaticProbe

    forced = _forced_failure(plan.agent.testing, ctx)
    if forced is not None:
        print(
            f"hpclaunch: node {ctx.hostname} failed check {forced.check}: {forced.finding}", file=sys.stderr
        )
        return forced, [{"name": "gpu", "status": "fail", "finding": forced.finding or ""}]
    if not plan.agent.node_checks or checked is None:
        return NodeVerdict(ctx.node_rank, ctx.hostname, True), []
    # The env probe (a job-Python import of torch) costs seconds per attempt and the rank host
    # would fail just as clearly; the other checks are cheap and find broken nodes before rendezvous.
    # No probe at all: the disk check sizes checkpoints by formula and the GPU check counts GPUs
    # with nvidia-smi, instead of a torch import that cost 3-15 s of every restart (bench/restart_cost.py).
    no_probe = StaticProbe(error="not run on nodes (it imports torch)")
    report = within_deadline(
        lambda: run_node_checks(checked, ctx, only=set(NODE_CHECKS) - {"env"}, probe=no_probe),
        CHECKS_DEADLINE_S,
    )
    if report is None:
        finding = (
            f"the node checks did not finish within {CHECKS_DEADLINE_S:.0f} s (a stuck filesystem or driver)"
        )
        print(f"hpclaunch: node {ctx.hostname} failed its checks: {finding}", file=sys.stderr, flush=True)
        return NodeVerdict(ctx.node_rank, ctx.hostname, False, "deadline", finding), [
            {"name": "deadline", "status": "fail", "finding": finding}
        ]
    rows: list[CheckRow] = [
        {"name": c.name, "status": c.status.value, "finding": c.finding} for c in report.checks
    ]
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


# How long a file that exists (its exclusive create said so) may stay unreadable before the agent
# waiting for it gives up: an agent error (``agent_exit``), the role moving on, never the run's.
STANDING_READ_S = float(os.environ.get("HPCLAUNCH_STANDING_READ_S") or 300.0)


def read_standing(path: Path, *, clock: Callable[[], float] = time.monotonic) -> Any:
    """The JSON of ``path``, which exists (another writer's exclusive create won): read until it can
    be, for ``STANDING_READ_S`` at most; then an ``OSError`` (EIO) naming it."""
    deadline = clock() + STANDING_READ_S
    while (data := poll_json(path)) is None:
        if clock() >= deadline:
            raise OSError(errno.EIO, f"unreadable for {STANDING_READ_S:.0f} s", str(path))
        time.sleep(POLL_S)
    return data


def within_deadline(work: Callable[[], T], deadline_s: float) -> T | None:
    """``work()``'s answer, or None when it has none within ``deadline_s``. Every command a check
    starts has its own deadline (``proc``), but a check can also block in the kernel (``statvfs`` of
    a hung mount, a driver's sysfs file): it runs in a daemon thread that is left behind, and the
    node counts as failed, so a spare takes its place instead of the allocation waiting."""
    answer: list[T] = []
    failed: list[BaseException] = []
    done = threading.Event()

    def target() -> None:
        try:
            answer.append(work())
        except BaseException as e:  # raised again in the caller's thread
            failed.append(e)
        finally:
            done.set()

    threading.Thread(target=target, name="hpclaunch-node-checks", daemon=True).start()
    if not done.wait(deadline_s):
        return None
    if failed:
        raise failed[0]
    return answer[0]


def _forced_failure(testing: TestingConfig, ctx: NodeContext) -> NodeVerdict | None:
    """``testing.fail_node_check``: a named host fails its check from the in-place attempt given on
    (a bad GPU found between attempts on a machine that has none to break)."""
    knob = testing.fail_node_check
    if knob is None or knob.host != ctx.hostname or ctx.in_place < knob.from_in_place:
        return None
    finding = "testing.fail_node_check: GPU 0 reports an uncorrectable ECC error (injected)"
    return NodeVerdict(ctx.node_rank, ctx.hostname, False, "gpu", finding)


@dataclass(frozen=True)
class Word:
    """What a waiting node heard: the decider's go (and the roster), a stop, or nothing yet because
    the decider is gone and this node takes over (``take_over``)."""

    go: bool
    reason: str = ""
    roster: RosterJSON | None = None
    take_over: bool = False
    ours: bool = False  # (the decider's ``announce``) this word is the one it created


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
        retry_patiently(lambda: atomic_write_json(self._node_file(verdict.node_rank), asdict(verdict)))

    def gather(
        self,
        nodes: dict[int, str],
        *,
        timeout_s: float = GATHER_TIMEOUT_S,
        gone: Callable[[str], bool] | None = None,
    ) -> Verdicts:
        """The decider: the verdict of every node in ``nodes`` (node rank -> host). A node silent for
        ``timeout_s``, or whose agent is gone (``gone``: its heartbeat stopped), counts as failed."""
        began = self.clock()
        deadline = began + timeout_s
        found: dict[int, NodeVerdict] = {}
        dead: dict[int, NodeVerdict] = {}
        next_look = began  # liveness is looked at once per second, not per poll (N reads each)
        while True:
            look = gone is not None and self.clock() >= next_look
            next_look = self.clock() + LOOK_S if look else next_look
            for rank, host in nodes.items():
                if rank not in found:
                    verdict = self._read(rank)
                    if verdict is not None:
                        found[rank] = verdict
                        dead.pop(rank, None)
                    elif look and gone is not None and gone(host):
                        dead[rank] = NodeVerdict(
                            rank, host, False, "start", "its agent is gone (no heartbeat)"
                        )
            if len(found) + len(dead) == len(nodes) or self.clock() >= deadline:
                break
            time.sleep(POLL_S)
        waited = self.clock() - began
        for rank, verdict in list(found.items()):  # reported, then died (before its rank host started)
            if verdict.ok and gone is not None and gone(verdict.host):
                found[rank] = NodeVerdict(
                    rank, verdict.host, False, "start", "its agent is gone (no heartbeat)"
                )
        return Verdicts(
            [found.get(r) or dead.get(r) or NodeVerdict.missing(r, h, waited) for r, h in nodes.items()]
        )

    def announce(
        self, *, go: bool, reason: str = "", roster: RosterJSON | None = None, epoch: int = 0
    ) -> Word:
        """The decider's word to every node: go or not, and who trains (the roster) when it goes;
        made with the run lock's ``epoch`` its decider holds. Created exclusively: when a word stands
        already (another decider's, one deposed meanwhile included), that one is returned and holds
        for every node (``Word.ours`` false): two rosters can never be announced."""
        word = {"go": go, "reason": reason, "roster": roster, "epoch": epoch}
        text = json.dumps(word, indent=2, sort_keys=True) + "\n"
        if retry_patiently(lambda: create_exclusive(self.dir / "go.json", text)):
            return Word(go, reason, roster, ours=True)
        return self._word(read_standing(self.dir / "go.json", clock=self.clock))

    @staticmethod
    def _word(data: Any) -> Word:
        return Word(bool(data.get("go")), str(data.get("reason") or ""), data.get("roster"))

    def wait_go(self, *, timeout_s: float, take_over: Callable[[], bool] | None = None) -> Word:
        """A waiting node: the decider's word; ``take_over()`` true (the decider is gone and this node
        is next) ends the wait so that this node gathers and announces; silence for ``timeout_s`` is
        a stop."""
        deadline = self.clock() + timeout_s
        while self.clock() < deadline:
            data = poll_json(self.dir / "go.json")
            if isinstance(data, dict):
                return self._word(data)
            if take_over is not None and take_over():
                return Word(False, take_over=True)
            time.sleep(POLL_S)
        return Word(False, f"the deciding node gave no word within {timeout_s:.0f} s")

    def _read(self, rank: int) -> NodeVerdict | None:
        data = poll_json(self._node_file(rank))
        try:
            return NodeVerdict(**data) if isinstance(data, dict) else None
        except TypeError:
            return None
