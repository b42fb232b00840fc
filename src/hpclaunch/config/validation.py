"""Validation and its wording: ``validate_config`` turns pydantic's first error into one
``ConfigError`` that names the dotted key, the bad value, what is allowed and the layer (file,
``--set``, flag) that set it; an unknown key gets a did-you-mean (``_unknown_key``)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from pydantic import BaseModel, ValidationError

from ..errors import ConfigError, did_you_mean
from .keys import RETIRED_KEYS
from .layers import layer_that_set, source_of
from .run_config import RunConfig
from .section_base import KeyedValueError, _section_model


def validate_config(
    raw: Mapping[str, Any], *, where: str = "config", sources: Mapping[str, str] | None = None
) -> RunConfig:
    """The typed config; ``sources`` (dotted key -> file, from ``merge_layers``) names in an error
    the file that set the bad key instead of ``where``."""
    try:
        cfg = RunConfig.model_validate(raw)
    except ValidationError as e:
        raise _first_error(e, where, sources or {}) from None
    cfg._sources, cfg._where = dict(sources or {}), where
    return cfg


def _unknown_key(parts: Sequence[str], allowed: Iterable[str], *, where: str) -> ConfigError:
    dotted = ".".join(parts)
    retired = RETIRED_KEYS.get(tuple(parts))  # type: ignore[arg-type]
    if retired is not None:
        return ConfigError(f"{dotted!r} was removed: {retired}", where=where, hint=f"delete {dotted}")
    prefix = ".".join(parts[:-1])
    allowed = list(allowed)
    suggestion = did_you_mean(parts[-1], allowed, prefix=prefix + "." if prefix else "")
    return ConfigError(
        f"unknown key {dotted!r}{suggestion}",
        where=where,
        hint=f"keys allowed {'under ' + prefix if prefix else 'at the top level'}: {', '.join(allowed)}",
    )


def _first_error(e: ValidationError, where: str, sources: Mapping[str, str]) -> ConfigError:
    err = e.errors(include_url=False)[0]
    loc = [str(p) for p in err["loc"]]
    keyed = (err.get("ctx") or {}).get("error")
    if isinstance(keyed, KeyedValueError):
        return _cross_field_error(keyed, loc, where, sources)
    where = source_of(".".join(p for p in loc if not p.isdigit()), sources, where)
    if err["type"] == "extra_forbidden":
        model: type[BaseModel] = RunConfig
        for part in loc[:-1]:
            sub = _section_model(model.model_fields[part].annotation) if part in model.model_fields else None
            if sub is None:
                break
            model = sub
        return _unknown_key(loc, list(model.model_fields), where=where)
    dotted = ".".join(p for p in loc if not p.isdigit()) or "config"
    field = _field_at(dotted.split("."))
    section = _section_model(field.annotation) if field is not None else None
    if err["type"] in ("model_type", "dict_type") and section is not None:
        # `--set train=5`: pydantic's words name an internal class ("instance of TrainConfig")
        keys = list(section.model_fields)
        return ConfigError(
            f"{dotted} is a section, not a value (got {err.get('input')!r})",
            where=where,
            hint=f"set one of its keys, e.g. {dotted}.{keys[0]}=...; keys under {dotted}: {', '.join(keys)}",
        )
    msg = str(err["msg"])
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
    shown = err.get("input")
    bad = (
        ""
        if isinstance(shown, dict) or err["type"] in ("value_error", "assertion_error")
        else f" (got {shown!r})"
    )
    if err["type"] == "missing":
        bad = ""
    return ConfigError(f"{dotted}: {msg}{bad}", where=where, hint=_hint_for(dotted))


def _cross_field_error(
    keyed: KeyedValueError, loc: list[str], where: str, sources: Mapping[str, str]
) -> ConfigError:
    """A rule across keys names every layer that set one of them, in the order they were applied
    (``my-run.yaml + --set``: a --set that made the file's value wrong is not blamed alone), and,
    with more than one, which key each set; a key no layer set has its default, and is not said.
    ``where``: the config's name (load_config's: its files in the order they were merged)."""
    dotted = ".".join([*loc, keyed.key])
    keys = [dotted, *(".".join([*loc, k]) for k in keyed.related)]
    set_by = {key: layer for key in keys if (layer := layer_that_set(key, sources)) is not None}
    layers = sorted(dict.fromkeys(set_by.values()), key=lambda name: _layer_rank(name, where.split(" + ")))
    said = (
        f" ({', '.join(f'{key} from {layer}' for key, layer in set_by.items())})" if len(layers) > 1 else ""
    )
    section = source_of(".".join(p for p in loc if not p.isdigit()), sources, where)
    return ConfigError(
        f"{dotted}: {keyed}{said}", where=" + ".join(layers) or section, hint=keyed.hint or _hint_for(dotted)
    )


def _layer_rank(name: str, files: list[str]) -> int:
    """Which layer came later: files in the order they were merged, flags (``--set``) after every
    file; anything else (the defaults) first."""
    if name.startswith("--"):
        return len(files) + 1
    return files.index(name) if name in files else -1


def _hint_for(dotted: str) -> str:
    field = _field_at(dotted.split("."))
    if field is not None and field.description:
        return f"{dotted}: {field.description}"
    return "see 'hpclaunch config schema' for every key, its type and bounds"


def _field_at(parts: Sequence[str]) -> Any:
    model: type[BaseModel] | None = RunConfig
    field = None
    for part in parts:
        if model is None or part not in model.model_fields:
            return None
        field = model.model_fields[part]
        model = _section_model(field.annotation)
    return field
