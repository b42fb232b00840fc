"""What every section builds on: the section base, the value formats (durations, names, values that
go into directive lines) and the error a cross-field rule raises (``KeyedValueError``)."""

from __future__ import annotations

import re
from types import UnionType
from typing import Any, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator

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
    # allow_inf_nan: no float key means "infinite" (mem_gb: .inf crashed the render; nan passes ge=0).
    model_config = ConfigDict(extra="forbid", validate_default=True, frozen=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_boolean_for_a_number(cls, value: Any, info: ValidationInfo) -> Any:
        """pydantic reads true as 1 where a number is wanted (``--set train.steps=true`` ran 1
        step): every section's number keys, and the numbers in its lists, refuse a boolean."""
        field = cls.model_fields.get(info.field_name or "")
        if field is None:
            return value
        if isinstance(value, bool) and _takes_number(field.annotation):
            raise ValueError(f"{str(value).lower()} is a boolean, not {_a_number(field.annotation)}")
        item = _list_item(field.annotation)
        if isinstance(value, list) and item is not None and _takes_number(item):
            for i, entry in enumerate(value):
                if isinstance(entry, bool):
                    raise ValueError(f"entry {i}: {str(entry).lower()} is a boolean, not {_a_number(item)}")
        return value


def _scalar_types(annotation: Any) -> set[Any]:
    """The plain types ``annotation`` admits at its top (``int | Literal["all"] | None``: int, None)."""
    if get_origin(annotation) in (Union, UnionType):
        return set().union(*(_scalar_types(arg) for arg in get_args(annotation)))
    return {annotation}


def _takes_number(annotation: Any) -> bool:
    types = _scalar_types(annotation)
    return bool(types & {int, float}) and bool not in types


def _a_number(annotation: Any) -> str:
    return "a number" if float in _scalar_types(annotation) else "a whole number"


def _list_item(annotation: Any) -> Any:
    """The entry type of a ``list[X]`` (or ``list[X] | None``) annotation; None for anything else."""
    for candidate in _scalar_types(annotation):
        if get_origin(candidate) is list:
            return get_args(candidate)[0]
    return None


class KeyedValueError(ValueError):
    """A cross-field error that names the dotted key (relative to the model raising it) and the
    other keys it depends on (``related``, same base): the error then names every layer that set
    one of them (a ``--set train.steps=5`` against a file's warmup: ``run.yaml + --set``), and
    ``hint`` (what to set) or else the key's description."""

    def __init__(self, key: str, message: str, *, related: tuple[str, ...] = (), hint: str | None = None):
        super().__init__(message)
        self.key = key
        self.related = related
        self.hint = hint  # what to set; None: the key's description


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
