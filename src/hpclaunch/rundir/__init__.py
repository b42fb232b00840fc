"""The run directory's contract: its paths, the ledger, how attempts ended, the plan, the lock.

Every side reads and writes run files through this package: the CLI and the orchestrator (login
side), the node agent and the local controller (allocation side) and the trainer (every rank).
It imports none of them; only ``config``, ``errors`` and ``fsutil`` below it.
"""

from .ledger import (
    CANCELLED,
    CHECKPOINT_FAILED,
    CHECKPOINT_INVALID,
    CHECKPOINT_SAVED,
    ENDED,
    FAILED,
    FINISHED,
    HANG,
    HELD,
    NCCL_PRESET,
    NODE_EXCLUDED,
    NODE_PREFLIGHT,
    PREFLIGHT_SKIPPED,
    REFUSED,
    REQUEUED,
    RESUMED,
    RUN_ENDS,
    STARTED,
    STOP_OVERDUE,
    STOP_REQUESTED,
    STOPPED,
    STRAGGLER,
    SUBMITTED,
    EventLog,
    Ledger,
    read_events,
)
from .lock import Heartbeat, LockHolder, RunLock, holder_alive
from .outcome import AttemptOutcome, latest_outcome, read_outcome, write_outcome
from .paths import RunPaths
from .plan import JobPlan, SweepPoint, TorchrunPlan, read_plan
from .readers import read_config, read_sweep

__all__ = [
    "CANCELLED",
    "CHECKPOINT_FAILED",
    "CHECKPOINT_INVALID",
    "CHECKPOINT_SAVED",
    "ENDED",
    "FAILED",
    "FINISHED",
    "HANG",
    "HELD",
    "NCCL_PRESET",
    "NODE_EXCLUDED",
    "NODE_PREFLIGHT",
    "PREFLIGHT_SKIPPED",
    "REFUSED",
    "REQUEUED",
    "RESUMED",
    "RUN_ENDS",
    "STARTED",
    "STOPPED",
    "STOP_OVERDUE",
    "STOP_REQUESTED",
    "STRAGGLER",
    "SUBMITTED",
    "AttemptOutcome",
    "EventLog",
    "Heartbeat",
    "JobPlan",
    "Ledger",
    "LockHolder",
    "RunLock",
    "RunPaths",
    "SweepPoint",
    "TorchrunPlan",
    "holder_alive",
    "latest_outcome",
    "read_config",
    "read_events",
    "read_outcome",
    "read_plan",
    "read_sweep",
    "write_outcome",
]
