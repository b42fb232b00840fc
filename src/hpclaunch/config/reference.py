"""The reference of every key (docs/configuration.md, ``make docs``; ``hpclaunch init``) and the
JSON schema (``hpclaunch config schema``)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any, Literal, get_args, get_origin

from pydantic import BaseModel

from .run_config import RunConfig
from .section_base import INTERNAL_SECTIONS, _section_model


def json_schema() -> dict[str, Any]:
    return RunConfig.model_json_schema()


def iter_reference_rows() -> Iterable[tuple[str, str, str, str]]:
    """(dotted key, type, default, description) for every leaf key: the config reference
    (docs/configuration.md)."""

    def walk(model: type[BaseModel], prefix: str) -> Iterable[tuple[str, str, str, str]]:
        for name, field in model.model_fields.items():
            dotted = f"{prefix}{name}"
            if dotted in INTERNAL_SECTIONS:
                continue
            sub = _section_model(field.annotation)
            if sub is not None and get_origin(field.annotation) is not dict:
                if field.default is None:  # an optional section, off by default: the row that turns it on
                    yield dotted, "section \\| null", "null", field.description or ""
                yield from walk(sub, dotted + ".")
                continue
            default = field.get_default(call_default_factory=True)
            yield dotted, _type_name(field.annotation), json.dumps(default), field.description or ""

    yield from walk(RunConfig, "")


def _type_name(annotation: Any) -> str:
    origin = get_origin(annotation)
    if origin is Literal:
        return " \\| ".join(str(a) for a in get_args(annotation))
    if origin is None:
        return getattr(annotation, "__name__", str(annotation))
    args = [a for a in get_args(annotation) if a is not type(None)]
    name = " \\| ".join(_type_name(a) for a in args)
    if origin in (list, tuple, dict):
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in args)}]"
    return name + (" \\| null" if type(None) in get_args(annotation) else "")
