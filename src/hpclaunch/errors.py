"""Typed user-facing errors.

Every error a user can cause is raised deep in the code as one of these and formatted once, at the
CLI boundary, as a single line ``what: where`` plus a hint line (``what to do``). Tracebacks are
only shown with ``HPCLAUNCH_DEBUG=1``.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Iterable

DEBUG_VAR = "HPCLAUNCH_DEBUG"


def debug_enabled() -> bool:
    """``HPCLAUNCH_DEBUG=1``: show tracebacks instead of the one-line error (CLI, trainer, checks)."""
    return os.environ.get(DEBUG_VAR, "") not in ("", "0", "false", "no")


def did_you_mean(word: str, choices: Iterable[str], *, prefix: str = "") -> str:
    """`` (did you mean X?)`` naming the closest choice, or ``""``: every "unknown name" error's tail."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {prefix}{close[0]}?)" if close else ""


class HpclaunchError(Exception):
    """Base class. ``exit_code`` is what the CLI returns: 2 = bad input, 1 = a check/run failed."""

    exit_code = 1

    def __init__(self, message: str, *, where: str | None = None, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.where = where
        self.hint = hint

    def one_line(self) -> str:
        """``where: message`` on one line (newlines in values are made visible, never printed)."""
        text = f"{self.where}: {self.message}" if self.where else self.message
        return text.replace("\n", "\\n")

    def __str__(self) -> str:
        return self.one_line()


class UserInputError(HpclaunchError):
    """Bad input from the user (config, flags, paths): exit code 2, nothing written or submitted."""

    exit_code = 2


class ConfigError(UserInputError):
    """A config value is missing, unknown, of the wrong type or contradicts another one."""


class ScriptLintError(UserInputError):
    """A rendered job script would not work as intended (refused before anything is written)."""


class DataError(UserInputError):
    """The training data is missing or malformed; ``where`` names the file."""


# What a scheduler answers when it will never accept the request as asked (SLURM's sbatch and
# scontrol, PBS's qsub): asking again cannot help, unlike a busy controller's timeout.
REFUSED_FOR_GOOD = (
    "requested node configuration is not available",
    "invalid partition",
    "invalid account",
    "invalid qos",
    "violates accounting/qos policy",
    "requested time limit is invalid",
    "node count specification invalid",
    "invalid node name",
    "invalid feature specification",
    "invalid generic resource",
    "more processors requested than permitted",
    "access/permission denied",
    "job exceeds queue resource limits",
    "unknown queue",
    "unknown resource",
    "illegal attribute or resource value",
    "unauthorized request",
)


class SchedulerError(HpclaunchError):
    """The scheduler refused or failed a request (sbatch/qsub/scontrol returned an error)."""

    @property
    def refused_for_good(self) -> bool:
        """The scheduler will never accept this request as asked (not worth asking again)."""
        text = self.message.lower()
        return any(phrase in text for phrase in REFUSED_FOR_GOOD)


class RunNotFoundError(UserInputError):
    """A run directory named on the command line does not exist or is not a run."""


class RunLockedError(UserInputError):
    """Another live writer (a job, a foreground train) holds the run directory."""


class RunStateError(UserInputError):
    """A command that cannot apply to the run's state (stop a run that has ended, resume a finished
    one): nothing is written or submitted."""


class CheckpointError(HpclaunchError):
    """A checkpoint cannot be written, validated or loaded."""


class PreflightFailed(HpclaunchError):
    """At least one preflight check failed."""


class FilesystemError(HpclaunchError):
    """The run's files cannot be read or written now (EIO, ESTALE, a permission that flickers):
    not the files' fault, so never a reason to set a checkpoint aside; the attempt fails as a
    filesystem problem and is retried like a crash."""


class TrainingError(HpclaunchError):
    """The training run cannot continue (too many non-finite steps, incompatible checkpoint)."""


def error_text(e: BaseException) -> str:
    """An exception in one line: its type and the first line of its message."""
    first = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {first}" if first else type(e).__name__
