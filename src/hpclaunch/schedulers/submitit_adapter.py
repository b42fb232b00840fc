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
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..templates.shell import quote, slurm_filename

TESTED = ">=1.5.1,<1.6"  # keep in step with pyproject.toml
SUBMITIT_MARKER = "export SUBMITIT_EXECUTOR=slurm"
# The log folder as submitit sees it: the real one goes in afterwards, escaped (``sbatch_text``).
# No '%' (submitit rewrites %j and %t in the whole path); a space, so that submitit quotes each
# path that holds it as one word, and no run directory (a directive value: no spaces) can hold it.
FOLDER_STAND_IN = "/hpclaunch log folder"
_STOOD_IN = re.compile("'" + re.escape(FOLDER_STAND_IN) + "/([^'/]*)'")


def sbatch_text(*, command: str, folder: Path, **parameters: Any) -> str:
    """submitit's sbatch file for ``command`` (a shell command line, already quoted).

    The log folder is a file-name pattern's literal part (``#SBATCH --output``, ``srun --output``;
    ``--error`` too where stderr is apart): SLURM expands ``%`` patterns there, so each ``%`` of the
    folder is doubled (``shell.slurm_filename``) while the patterns submitit adds (``%j``, ``%t``,
    ``%A_%a``) stay. submitit formats with a stand-in folder, which the escaped one then replaces:
    given the real one, it would rewrite a ``%j`` or ``%t`` of the folder itself."""
    from submitit.slurm.slurm import _make_sbatch_string

    if FOLDER_STAND_IN in command or FOLDER_STAND_IN in repr(parameters):
        raise ValueError(f"{FOLDER_STAND_IN!r} is reserved for the log folder")
    text = str(_make_sbatch_string(command=command, folder=FOLDER_STAND_IN, **parameters))
    real = slurm_filename(str(Path(folder).expanduser().absolute()))
    text = _STOOD_IN.sub(lambda m: quote(f"{real}/{m.group(1)}"), text)
    if FOLDER_STAND_IN in text:
        raise ValueError(f"submitit wrote the log folder in a form this adapter does not know:\n{text}")
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
