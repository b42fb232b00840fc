"""What every check works with: the context (config, node, probe, outside world) and a findings list.

A check is a function ``(CheckContext) -> Outcome``. It gathers findings (pass / warn / fail / skip,
each one line with an optional hint); the outcome is the worst of them. Everything a check needs
from the outside world goes through the context (``sysfs_root``, ``environ``, ``run``), so that
tests can hand it fakes for what cannot exist here (InfiniBand, GPUs).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .. import proc
from ..config import RunConfig
from ..probe_shapes import ProbeAnswer
from ..schedulers.protocol import NodeContext
from .probe import Probe, ProbeError, StaticProbe
from .results import Status
from .sizes import estimate_parameters


@dataclass(frozen=True)
class Outcome:
    status: Status
    finding: str
    hint: str | None = None


@dataclass(frozen=True)
class CommandResult:
    returncode: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def error_line(self) -> str:
        text = (self.stderr or self.stdout).strip().splitlines()
        return text[-1][:300] if text else f"exit code {self.returncode}"


RunCommand = Callable[[Sequence[str], float], "CommandResult | None"]


def run_command(argv: Sequence[str], timeout: float) -> CommandResult | None:
    """Run a tool; None when it is not installed, returncode 124 when it timed out (its whole process
    group killed: a stuck ``nvidia-smi`` never holds the node checks past ``timeout``, ``proc``)."""
    if shutil.which(argv[0]) is None:
        return None
    try:
        p = proc.run(argv, timeout=timeout)
    except subprocess.TimeoutExpired:
        return CommandResult(124, "", f"{argv[0]} did not answer within {timeout:g} s")
    except OSError as e:
        return CommandResult(126, "", f"{argv[0]}: {e.strerror}")
    return CommandResult(p.returncode, p.stdout, p.stderr)


@dataclass
class CheckContext:
    """One preflight run: login node (``node`` is None) or an allocated node."""

    cfg: RunConfig
    node: NodeContext | None
    probe: Probe | StaticProbe
    sysfs_root: Path = Path("/sys")
    environ: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))
    run: RunCommand = run_command
    which: Callable[[str], str | None] = shutil.which
    hostname: str = field(default_factory=lambda: socket.gethostname())
    _params: tuple[int, bool] | None = field(default=None, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    @property
    def on_node(self) -> bool:
        return self.node is not None

    @property
    def where(self) -> str:
        return f"node {self.node.hostname}" if self.node is not None else "login"

    @property
    def sees_compute_hardware(self) -> bool:
        """True where the job's GPUs and NICs are visible: on a node, or for the local scheduler."""
        return self.node is not None or self.cfg.scheduler.kind == "local"

    def probe_result(self) -> ProbeAnswer | None:
        try:
            return self.probe.result()
        except ProbeError:
            return None

    def parameters(self) -> tuple[int, bool]:
        """(parameter count, exact?) from the probe's model, else the formula."""
        with self._lock:
            if self._params is None:
                info = (self.probe_result() or {}).get("model") or {}
                if isinstance(info.get("params"), int):
                    self._params = (info["params"], True)
                else:
                    self._params = (estimate_parameters(self.cfg.model), False)
            return self._params


class Findings:
    """Accumulates one check's findings; ``outcome()`` is the worst, its messages joined on one line."""

    def __init__(self) -> None:
        self.items: list[tuple[Status, str, str | None]] = []

    def ok(self, message: str) -> None:
        self.items.append((Status.PASS, message, None))

    def warn(self, message: str, hint: str | None = None) -> None:
        self.items.append((Status.WARN, message, hint))

    def fail(self, message: str, hint: str | None = None) -> None:
        self.items.append((Status.FAIL, message, hint))

    def skip(self, message: str) -> None:
        self.items.append((Status.SKIP, message, None))

    def outcome(self) -> Outcome:
        if not self.items:
            return Outcome(Status.SKIP, "nothing to check here")
        worst = max(self.items, key=lambda i: i[0].rank)[0]
        chosen = [i for i in self.items if i[0] is worst]
        if worst is Status.PASS:
            # a pass line also names what was skipped, so the reader knows what was not looked at
            chosen += [i for i in self.items if i[0] is Status.SKIP]
        hint = next((h for _, _, h in chosen if h), None)
        return Outcome(worst, "; ".join(m for _, m, _ in chosen), hint)


def skip(message: str) -> Outcome:
    return Outcome(Status.SKIP, message)
