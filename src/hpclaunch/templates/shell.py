"""The one function that quotes values for a shell, and the checks for what cannot be quoted.

Every value that reaches a job script goes through ``quote`` (Jinja templates apply it to every
``{{ expression }}`` via ``finalize``), and so does every path or value in a command line hpclaunch
suggests to the user ("follow it: hpclaunch status RUN --watch"), so that it can be copied into a
shell as printed (a plain path stays as it is). Values in ``#SBATCH``/``#PBS`` directive lines
cannot be quoted reliably (each scheduler parses them its own way), so those are checked against a
strict character set instead and refused with a clear message; a path the scheduler reads as a
file-name pattern (``slurm_filename``) or as ``[host:]path`` (``pbs_output_path``) is escaped or
refused as well.
"""

from __future__ import annotations

import re
import shlex

from ..errors import UserInputError

_DIRECTIVE_SAFE = re.compile(r"^[A-Za-z0-9._:@%+,=/-]+$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class Raw(str):
    """Text that is already shell syntax (a user's setup line, a generated command); not quoted."""


def quote(value: object) -> str:
    """Shell-quote ``value`` for bash (``Raw`` passes through). NUL bytes are refused."""
    if isinstance(value, Raw):
        return str(value)
    text = str(value)
    if "\x00" in text:
        raise UserInputError("a value contains a NUL byte, which no shell can carry", where=repr(text[:40]))
    return shlex.quote(text)


def join(argv: list[str]) -> str:
    """A command line from an argument list, every argument quoted."""
    return " ".join(quote(a) for a in argv)


def export_line(name: str, value: str) -> str:
    if not _ENV_NAME.match(name):
        raise UserInputError(f"{name!r} is not a valid environment variable name", where="environment")
    return f"export {name}={quote(value)}"


def directive_value(value: str, *, what: str) -> str:
    """``value`` unchanged when it is safe inside a directive line; a clear refusal otherwise."""
    if not _DIRECTIVE_SAFE.match(value):
        raise UserInputError(
            f"{value!r} cannot be written into a #SBATCH/#PBS line",
            where=what,
            hint="use letters, digits and ._:@%+,=/- only (no spaces, quotes or shell syntax)",
        )
    return value


def slurm_filename(path: str) -> str:
    """``path`` as the literal part of a SLURM file-name pattern (``sbatch``/``srun`` ``--output``,
    ``--error``, ``--input``): SLURM expands ``%j``, ``%t``, ``%A``... there, and ``%%`` is a literal
    ``%``. The patterns hpclaunch adds after it (``/%j_%t_log.out``) stay patterns."""
    return path.replace("%", "%%")


def pbs_output_path(path: str, *, what: str, dialect: str) -> str:
    """``path`` for a ``#PBS -o``/``-e`` line, or a clear refusal. qsub reads those as
    ``[host:]path``: a path that begins with '/' has no host part (OpenPBS's and Torque's
    ``prepare_path`` stop looking for one at the first '/'), so a ':' after it is the path's; a
    relative one with a ':' could be taken for a host name's end (there is no escape for it). Under
    Slurm's Torque emulation (``--pbs-dialect torque``'s tested target) sbatch reads them as SLURM
    file-name patterns, where a ``%`` is expanded, while a real Torque takes it as it is: no spelling
    means the same to both."""
    value = directive_value(path, what=what)
    if ":" in value and not value.startswith("/"):
        raise UserInputError(
            f"the job's log path {value!r} holds a ':': qsub reads #PBS -o/-e as [host:]path, so "
            "the text before the ':' would be taken for a host name",
            where=what,
            hint="choose a run_dir without ':'",
        )
    if dialect == "torque" and "%" in value:
        raise UserInputError(
            f"the job's log path {value!r} holds a '%': Slurm's Torque emulation reads #PBS -o/-e as a "
            "file-name pattern (%j: the job id), a real Torque as it is",
            where=what,
            hint="choose a run_dir without '%'",
        )
    return value
