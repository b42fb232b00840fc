"""Everything hpclaunch takes from submitit, in one place.

- the sbatch file: submitit's own formatter (``#SBATCH`` lines from keyword parameters, the
  ``--signal=USR2@lead`` warning, ``--open-mode=append``, ``srun --unbuffered --output ...``) with
  hpclaunch's node agent as the command, so the script shows what really runs on every node;
- job tracking where Slurm has no JSON output (before 20.11): submitit's ``sacct --parsable2``
  watcher;
- a clean environment for submitting from inside a job (``helpers.clean_env``).

Submission itself is ``sbatch --parsable`` of the rendered file: submitit's executors pickle a
Python callable and run ``submitit.core._submit`` on the nodes, which would hide the real command
from ``hpclaunch render``. The formatter is submitit's only private name used here;
``tests/unit/test_submitit_adapter.py`` fails when its behaviour changes, and pyproject pins the
range that test has passed on.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

TESTED = ">=1.5.1,<1.6"  # keep in step with pyproject.toml
SUBMITIT_MARKER = "export SUBMITIT_EXECUTOR=slurm"


def sbatch_text(*, command: str, folder: Path, **parameters: Any) -> str:
    """submitit's sbatch file for ``command`` (a shell command line, already quoted)."""
    from submitit.slurm.slurm import _make_sbatch_string

    text = str(_make_sbatch_string(command=command, folder=folder, **parameters))
    # submitit's marker for its own JobEnvironment inside a job; the node agent never asks it, and
    # an admin reading the script should not wonder what it is for.
    return text.replace(f"\n{SUBMITIT_MARKER}\n", "\n", 1)


def sacct_state(job_id: str) -> str | None:
    """The job's state word from ``sacct --parsable2`` through submitit's watcher (None: unknown)."""
    from submitit.slurm.slurm import SlurmInfoWatcher

    watcher = SlurmInfoWatcher(delay_s=0)
    watcher.register_job(job_id)
    state = watcher.get_state(job_id, mode="force")
    return None if state in ("", "UNKNOWN") else state.split()[0].upper()


@contextlib.contextmanager
def clean_env() -> Iterator[None]:
    """No SLURM_*/SUBMITIT_* or torch.distributed variables leak into a job submitted from a job."""
    from submitit.helpers import clean_env as _clean_env

    with _clean_env():
        yield
