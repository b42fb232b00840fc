"""Every path inside one run directory, in one place.

```
RUN/
  config.yaml      the resolved config (what actually runs)
  plan.json        the JobPlan
  job.sbatch | job.pbs | job.local.sh    the script handed to the scheduler
  sweep.json       a sweep's points (only at a sweep's root)
  lock.json        who writes to this run now (``lock``)
  events/          the ledger: one file per writer (``ledger``)
  metrics.jsonl    rank 0's metrics lines
  attempts/        how each attempt ended (``outcome``)
  logs/            per attempt, per node
  checkpoints/     unless checkpoint.dir says otherwise
  control/         stop requests (``control``)
  scheduler/       scheduler-owned files (submitit folder, local controller state)
```
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

# A published checkpoint's directory (``rank.checkpoint`` writes it; anything else in the folder
# is a temporary, a leftover or a checkpoint set aside as corrupt).
STEP_DIR_RE = re.compile(r"^step_(\d{6,})$")


@dataclass(frozen=True)
class RunPaths:
    """Every path inside one run directory (``checkpoint_dir``: where checkpoint.dir points)."""

    root: Path
    checkpoint_dir: Path | None = None

    @classmethod
    def of(cls, root: str | Path, checkpoint_dir: str | None) -> RunPaths:
        """The paths of a run whose ``checkpoint.dir`` is ``checkpoint_dir`` (None: inside the run)."""
        return cls(Path(root), Path(checkpoint_dir) if checkpoint_dir else None)

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def plan(self) -> Path:
        return self.root / "plan.json"

    @property
    def sweep(self) -> Path:
        return self.root / "sweep.json"

    @property
    def lock(self) -> Path:
        return self.root / "lock.json"

    @property
    def events_dir(self) -> Path:
        """The ledger: one append-only file per writing process (see ``rundir.ledger``)."""
        return self.root / "events"

    @property
    def legacy_events(self) -> Path:
        """The single ledger file of runs made before the ledger was split per writer."""
        return self.root / "events.jsonl"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def checkpoints(self) -> Path:
        return self.checkpoint_dir or self.root / "checkpoints"

    @property
    def control(self) -> Path:
        return self.root / "control"

    @property
    def stop_file(self) -> Path:
        """The user's stop request (``hpclaunch stop``; see ``rundir.control``)."""
        return self.control / "stop"

    def relay_stop_file(self, attempt: str) -> Path:
        """A node agent's relay of the scheduler's stop, for ``attempt`` only."""
        return self.control / f"stop.{attempt}"

    @property
    def attempts(self) -> Path:
        """One small JSON per attempt: how the trainer ended (written by rank 0)."""
        return self.root / "attempts"

    @property
    def scheduler_dir(self) -> Path:
        """Scheduler-owned files: submitit folder, local controller state."""
        return self.root / "scheduler"

    def outcome_file(self, attempt: str) -> Path:
        return self.attempts / f"{attempt}.json"

    def rank_outcome_file(self, attempt: str, rank: int) -> Path:
        """A rank other than 0 that failed on its own (its batch's data, its own error) says why."""
        return self.attempt_dir(attempt) / f"rank{rank}.outcome.json"

    def attempt_dir(self, attempt: str) -> Path:
        """Per-attempt coordination files (node checks of a multi-node start)."""
        return self.attempts / attempt

    def attempt_logs(self, attempt: str) -> Path:
        return self.logs / f"attempt-{attempt}"

    def node_log(self, attempt: str, node_rank: int) -> Path:
        return self.attempt_logs(attempt) / f"node{node_rank}.log"

    def ensure(self) -> RunPaths:
        for d in (
            self.root,
            self.events_dir,
            self.logs,
            self.checkpoints,
            self.control,
            self.attempts,
            self.scheduler_dir,
        ):
            d.mkdir(parents=True, exist_ok=True)
        return self

    def ensure_sweep_root(self) -> RunPaths:
        """A sweep's root trains nothing itself: its config, plan, script and sweep.json, the
        scheduler's folder (where the array is submitted from) and logs/ (a PBS array's output)."""
        for d in (self.root, self.logs, self.scheduler_dir):
            d.mkdir(parents=True, exist_ok=True)
        return self

    def is_run(self) -> bool:
        return self.plan.exists() or self.events_dir.is_dir() or self.legacy_events.exists()


def newest_checkpoint_step(paths: RunPaths) -> int | None:
    """The step of the newest published checkpoint in the run's checkpoint folder (None: none): one
    listing, no manifest read (what an attempt would resume from, unless that one proves corrupt)."""
    try:
        names = [entry.name for entry in paths.checkpoints.iterdir()]
    except OSError:
        return None
    steps = [int(m.group(1)) for name in names if (m := STEP_DIR_RE.fullmatch(name))]
    return max(steps, default=None)
