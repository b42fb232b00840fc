"""Which node a crash is pinned on, from the evidence an attempt leaves behind.

A crash on one rank breaks every rank's collectives, so "which ranks failed" names everyone. What
names a node:

- **Certain**: text that only a sick machine writes (CUDA errors, ECC, Xid, a GPU fallen off the
  bus, NCCL's "unhandled system/cuda error") in the attempt's log of one node. GPUs and their
  memory caused 47 % of the unexpected interruptions of Llama 3's 16k-GPU run; such a node is
  evicted at once (a spare takes its place), never restarted in place.
- **A hint**: ranks that died by a signal their own agent did not send (a segfault, the OOM
  killer's SIGKILL, a bus error) on exactly one node, while the other nodes' ranks failed with
  ordinary errors or were stopped by their agents. One hint restarts in place on the same node (it
  may be a software fault); the same node hinted twice is evicted (``decide``'s History counts).

Nothing here imports torch: the agent reads the node reports and log tails after the attempt.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ..rundir.attempt_records import AttemptEnd

# Text a machine's failure writes into its ranks' output (CUDA runtime, the driver's Xid reports
# when forwarded, NCCL's own verdicts on a local fault). Not NCCL's "remote process exited" or
# gloo's "Connection closed by peer": those are what every victim of someone else's crash says.
HARDWARE_TEXT = re.compile(
    r"CUDA error|cudaError|CUBLAS_STATUS_EXECUTION_FAILED|uncorrectable ECC|ECC error"
    r"|\bXid\b|illegal memory access|GPU is lost|fallen off the bus|NVML_ERROR"
    r"|unhandled system error|unhandled cuda error",
    re.IGNORECASE,
)
TAIL_BYTES = 256 * 1024  # the end of a node's log: where the failure is, whatever its size


@dataclass(frozen=True)
class Suspicion:
    node: str
    evidence: str  # in the user's words, for the decision's reason
    certain: bool


def hardware_line(log: Path) -> str | None:
    """The last line of ``log``'s tail that reads as a machine's failure, or None."""
    try:
        with log.open("rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - TAIL_BYTES))
            tail = f.read().decode("utf-8", "replace")
    except OSError:
        return None
    found = [line.strip() for line in tail.splitlines() if HARDWARE_TEXT.search(line)]
    return found[-1][:200] if found else None


def signal_deaths(report: AttemptEnd) -> list[tuple[str, int]]:
    """(rank, signal) of the ranks in a node's report that died by a signal their agent did not
    send (the agent stops its ranks when another node ended the attempt: those deaths prove
    nothing)."""
    if report.get("stopped_by_agent"):
        return []
    failures = report.get("failures") or {}
    return [(str(r), -int(c)) for r, c in failures.items() if isinstance(c, int) and c < 0]


def suspect(reports: Mapping[int, AttemptEnd], logs: Mapping[str, Path]) -> Suspicion | None:
    """The node this attempt's crash is pinned on, or None when the evidence names no one node.

    ``reports``: node rank -> that node's report (``host``, the rank host's ``failures``);
    ``logs``: host -> its log of this attempt."""
    hardware = {host: line for host, log in logs.items() if (line := hardware_line(log)) is not None}
    if len(hardware) == 1:
        ((host, line),) = hardware.items()
        return Suspicion(host, f"its ranks reported a GPU fault ({line})", certain=True)
    killed = {str(rep.get("host")): deaths for rep in reports.values() if (deaths := signal_deaths(rep))}
    if len(killed) == 1 and len(reports) > 1:
        ((host, deaths),) = killed.items()
        said = ", ".join(f"rank {r} by signal {s}" for r, s in deaths)
        return Suspicion(host, f"its ranks died first ({said})", certain=False)
    return None
