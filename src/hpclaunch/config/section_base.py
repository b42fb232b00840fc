"""What every section builds on: the section base, the value formats (durations, names, values that
go into directive lines) and the error a cross-field rule raises (``KeyedValueError``)."""

from __future__ import annotations

import re
from typing import Any, get_args

from pydantic import BaseModel, ConfigDict

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
# Values that end up in #SBATCH/#PBS directive lines: no whitespace, quotes or shell syntax.
DIRECTIVE_VALUE_RE = re.compile(r"^[A-Za-z0-9._:@%+,=/-]+$")
ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_TIME_HMS = re.compile(r"^(?:(?P<d>\d+)-)?(?P<h>\d+):(?P<m>[0-5]?\d):(?P<s>[0-5]?\d)$")
_TIME_UNIT = re.compile(r"^(?P<n>\d+(?:\.\d+)?)(?P<u>[smhd])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> int:
    """Seconds in ``[D-]HH:MM:SS`` or ``<number><s|m|h|d>``; ValueError otherwise."""
    text = str(text).strip()
    if m := _TIME_HMS.match(text):
        d = int(m["d"] or 0)
        return ((d * 24 + int(m["h"])) * 60 + int(m["m"])) * 60 + int(m["s"])
    if m := _TIME_UNIT.match(text):
        return round(float(m["n"]) * _UNIT_S[m["u"]])
    raise ValueError(f"{text!r} is not a duration; use HH:MM:SS, D-HH:MM:SS or e.g. 90s, 30m, 2h")


def format_hms(seconds: int) -> str:
    """``HH:MM:SS`` (hours may exceed 24), the form both SLURM and PBS accept."""
    h, rest = divmod(int(seconds), 3600)
    m, s = divmod(rest, 60)
    return f"{h:02d}:{m:02d}:{s:02d}"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True, frozen=True)


class KeyedValueError(ValueError):
    """A cross-field error that names the dotted key (relative to the model raising it) and the
    other keys it depends on (``related``, same base): the error then names the layer that set any
    of them last (a ``--set train.steps=5`` against a file's warmup blames ``--set``)."""

    def __init__(self, key: str, message: str, *, related: tuple[str, ...] = ()):
        super().__init__(message)
        self.key = key
        self.related = related


def _check_directive_value(value: str | None, key: str) -> str | None:
    if value is not None and not DIRECTIVE_VALUE_RE.fullmatch(value):
        raise ValueError(
            f"{value!r} cannot go into a #SBATCH/#PBS line ({key} allows letters, digits and ._:@%+,=/-)"
        )
    return value


def _check_absolute(value: str | None, why: str) -> str | None:
    """``value`` unset or an absolute path; else "'V' is not an absolute path" and ``why``."""
    if value is not None and not value.startswith("/"):
        raise ValueError(f"{value!r} is not an absolute path{why}")
    return value


def _section_model(annotation: Any) -> type[BaseModel] | None:
    """The section model in ``annotation`` (``X``, ``X | None``, ``list[X]``); None for a plain value."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        found = _section_model(arg)
        if found is not None:
            return found
    return None


# The built-in MMDiT trainer's own sections: a script run (script.path) has none of them.
BUILTIN_SECTIONS = ("model", "data", "train")

# Sections that are not part of the user's reference (docs/configuration.md, `hpclaunch init`).
INTERNAL_SECTIONS = ("testing",)
