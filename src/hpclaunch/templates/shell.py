"""The one function that quotes values for a shell, and the checks for what cannot be quoted.

Every value that reaches a job script goes through ``quote`` (Jinja templates apply it to every
``{{ expression }}`` via ``finalize``). Values in ``#SBATCH``/``#PBS`` directive lines cannot be
quoted reliably (each scheduler parses them its own way), so those are checked against a strict
character set instead and refused with a clear message.
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
