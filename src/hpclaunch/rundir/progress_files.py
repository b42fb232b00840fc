"""Each rank's progress, its stacks and its step times: what a rank writes, the node agent's watchdog
and ``status`` read.

```
<node dir>/progress/.../rank<r>.progress.json   heartbeat, replaced about once a second (``local_progress_dir``)
RUN/attempts/<attempt>/node<n>.progress.json    the node agent's aggregate of its ranks' heartbeats
RUN/logs/attempt-<attempt>/rank<r>.stacks.txt   Python stacks of every thread, appended on STACK_SIGNAL
RUN/logs/attempt-<attempt>/nccl/                NCCL flight recorder: trigger pipes and dumps (NCCL only)
RUN/steptimes/rank<r>.jsonl                     one line per N steps: this rank's step time, split
RUN/attempts/<attempt>/hang.json                the decider's watchdog verdict (the other nodes act on it)
```

One file per rank, no collective: a rank stuck in a collective cannot take part in another one, and
a file per writer is the ledger's rule too (appends from several hosts are not atomic on NFS). The
ranks' heartbeats stay on their node (a file replaced per rank per second is a metadata operation
per rank per second on a shared filesystem: 4,096/s at 512 nodes of 8); their node agent reads them
there and keeps one file per node on the shared filesystem, rewritten in place (no metadata
operation), which ``status``, the decider and humans read. A rank started without an agent (a test,
a trainer run by hand) writes ``RUN/attempts/<attempt>/rank<r>.progress.json`` as before; both are
read (``read_progress``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import signal
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

from ..fsutil import JSONObject
from .paths import RunPaths

PHASES = ("startup", "load", "data", "compute", "collective", "save", "eval", "done")
# Where a phase lies within one step: a rank at a lower (step, order) is behind one at a higher.
PHASE_ORDER = {name: i for i, name in enumerate(PHASES)}
TRAINING_PHASES = ("data", "compute", "collective")

# The signal a worker dumps its stacks on (faulthandler, in C: it works while the main thread is
# stuck in a C call). SIGURG's default action is to do nothing, so a worker that has not registered
# the handler yet (still importing torch) ignores it instead of dying.
STACK_SIGNAL = signal.SIGURG

# File stems torch's flight recorder appends the rank to (TORCH_FR_DUMP_TEMP_FILE and
# TORCH_NCCL_DEBUG_INFO_PIPE_FILE): writing to "<pipe stem><rank>.pipe" makes a rank dump.
NCCL_TRACE_STEM = "nccl_trace_rank_"
NCCL_PIPE_STEM = "nccl_pipe_rank_"


def progress_file(paths: RunPaths, attempt: str, rank: int) -> Path:
    """A rank's heartbeat where no node agent collects it (the shared run directory)."""
    return paths.attempt_dir(attempt) / f"rank{rank}.progress.json"


def node_progress_file(paths: RunPaths, attempt: str, node_rank: int) -> Path:
    """A node agent's aggregate of its ranks' heartbeats (``jobs.node_progress``)."""
    return paths.attempt_dir(attempt) / f"node{node_rank}.progress.json"


def local_progress_dir(node_dir: Path, root: Path, host: str, attempt: str) -> Path:
    """The folder in this user's node directory (``rundir.node_dir``) a node's ranks write their
    heartbeats to, keyed by the run and the node (nodes that share a /tmp, as a test cluster's do,
    never share it)."""
    key = hashlib.sha256(str(Path(root).resolve()).encode()).hexdigest()[:16]
    return Path(node_dir) / "progress" / key / host / attempt


def stacks_file(paths: RunPaths, attempt: str, rank: int) -> Path:
    return paths.attempt_logs(attempt) / f"rank{rank}.stacks.txt"


def nccl_dump_dir(paths: RunPaths, attempt: str) -> Path:
    return paths.attempt_logs(attempt) / "nccl"


def steptimes_dir(paths: RunPaths) -> Path:
    return paths.root / "steptimes"


def steptimes_file(paths: RunPaths, rank: int) -> Path:
    return steptimes_dir(paths) / f"rank{rank}.jsonl"


class StepTimes(TypedDict):
    """One line of ``steptimes_file``: a rank's mean step over its last ``steps`` steps, split.
    Readers (the stragglers) check each figure: a line of another version may lack one."""

    ts: float
    attempt: str
    rank: int
    node: str
    step: int
    steps: int
    step_s: float
    work_s: float  # the rank's own work: step_s less its waits
    wait_s: float
    data_s: float
    compute_s: float
    collective_s: float
    basis: str  # cpu_time | host_phases: how work_s was measured


def hang_file(paths: RunPaths, attempt: str) -> Path:
    return paths.attempt_dir(attempt) / "hang.json"


@dataclass(frozen=True)
class ProgressRecord:
    """One rank's heartbeat as read back (see ``rank.progress`` for the writer)."""

    rank: int
    node: str
    pid: int | None
    step: int
    phase: str
    phase_since: float
    updated: float
    last_step_s: float | None = None  # wall time of the last step this attempt (None: no step yet)
    recent_max_step_s: float | None = None  # slowest of the last few steps
    waiting: str | None = None  # the torch.distributed call the main thread is blocked in, if any

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ProgressRecord:
        phase = str(data.get("phase", "startup"))
        return cls(
            rank=int(data["rank"]),
            node=str(data.get("node") or data.get("host") or "?"),
            pid=int(data["pid"]) if data.get("pid") is not None else None,
            step=int(data.get("step", 0)),
            phase=phase if phase in PHASE_ORDER else "startup",
            phase_since=float(data.get("phase_since", 0.0)),
            updated=float(data.get("updated", 0.0)),
            last_step_s=_float(data.get("last_step_s")),
            recent_max_step_s=_float(data.get("recent_max_step_s")),
            waiting=str(data["waiting"]) if data.get("waiting") else None,
        )

    @property
    def completed_step(self) -> int:
        """The last step this rank completed: one it is inside (data, compute, collective) is not."""
        return self.step - 1 if self.phase in TRAINING_PHASES else self.step


def furthest_completed_step(records: Mapping[int, ProgressRecord]) -> int | None:
    """The furthest step a rank completed (None: no record): in a data-parallel step no rank gets
    past the gradients' reduction alone, so every rank computed up to it."""
    return max((r.completed_step for r in records.values()), default=None)


def read_progress(paths: RunPaths, attempt: str) -> dict[int, ProgressRecord]:
    """Every rank's latest heartbeat of ``attempt``: from the node agents' aggregates and from the
    ranks' own files where no agent collected them (the newer wins); a rank without a readable
    record is left out."""
    out: dict[int, ProgressRecord] = {}
    directory = paths.attempt_dir(attempt)
    if not directory.is_dir():
        return out
    found: list[Any] = []
    for path in directory.glob("node*.progress.json"):
        with contextlib.suppress(OSError, ValueError):
            data = json.loads(path.read_text())
            found += data.get("ranks") or [] if isinstance(data, dict) else []
    for path in directory.glob("rank*.progress.json"):
        with contextlib.suppress(OSError, ValueError):
            found.append(json.loads(path.read_text()))
    for data in found:
        try:
            record = ProgressRecord.from_json(data)
        except (ValueError, KeyError, TypeError, AttributeError):
            continue  # (a file being written: read again next time)
        if record.rank not in out or record.updated >= out[record.rank].updated:
            out[record.rank] = record
    return out


def read_new_lines(path: Path, offset: int) -> tuple[list[JSONObject], int]:
    """Complete JSON lines of ``path`` after byte ``offset``, and the offset after the last one."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except OSError:
        return [], offset
    end = data.rfind(b"\n") + 1  # a line still being written waits for the next read
    lines: list[JSONObject] = []
    for raw in data[:end].splitlines():
        try:
            obj = json.loads(raw)
        except ValueError:
            continue
        if isinstance(obj, dict):
            lines.append(obj)
    return lines, offset + end


def _float(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) else None
