"""Layered configs: several files merged key by key (``merge_layers``), and which layer (a file,
``--set``, a command's flag) set each dotted key (``source_of``, ``layer_that_set``), so that an
error names it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import ConfigError
from .keys import _RENAMED_IN_SCHEDULER


def merge_layers(layers: Sequence[tuple[str, Mapping[str, Any]]]) -> tuple[dict[str, Any], dict[str, str]]:
    """Later layers override earlier ones key by key (mappings merge, anything else is replaced,
    lists whole); returns the merged mapping and, per dotted key, the layer that set it last."""
    merged: dict[str, Any] = {}
    sources: dict[str, str] = {}

    def merge(into: dict[str, Any], layer: Mapping[str, Any], name: str, prefix: str) -> None:
        for key, value in layer.items():
            dotted = f"{prefix}{key}"
            if isinstance(value, Mapping) and isinstance(into.get(key), dict):
                merge(into[key], value, name, dotted + ".")
            else:
                into[key] = _plain_copy(value)
                for known in [k for k in sources if k.startswith(dotted + ".")]:
                    del sources[known]  # a whole section replaced: its keys are this layer's now
                if isinstance(value, Mapping):
                    merge({}, value, name, dotted + ".")  # records who set each key inside it
            sources[dotted] = name

    for name, layer in layers:
        merge(merged, _new_names(layer, name), name, "")
    return merged, sources


def _new_names(layer: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    """``layer`` with renamed keys under their new names, so that a later layer's new name replaces
    an earlier layer's old one (``RENAMED_KEYS``)."""
    section = layer.get("scheduler")
    if not isinstance(section, Mapping) or not set(_RENAMED_IN_SCHEDULER) & set(section):
        return layer
    renamed: dict[str, Any] = {}
    for key, value in section.items():
        new = _RENAMED_IN_SCHEDULER.get(str(key), str(key))
        if new in renamed or (new != key and new in section):
            raise ConfigError(
                f"scheduler.{key} is the old name of scheduler.{new}; the file sets both",
                where=name,
                hint=f"keep only scheduler.{new}",
            )
        renamed[new] = value
    return {**layer, "scheduler": renamed}


def _plain_copy(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _plain_copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain_copy(v) for v in value]
    return value


def record_layer(sources: dict[str, str], dotted: str, name: str, value: Any) -> None:
    """``name`` (``--set``, a flag) set ``dotted`` to ``value`` as a whole: what earlier layers set
    under it is gone (``--set train={steps: 5}`` replaces the file's train section), and each key
    in ``value`` is ``name``'s, as ``merge_layers`` records a file's."""
    for known in [k for k in sources if k.startswith(dotted + ".")]:
        del sources[known]
    sources[dotted] = name
    if isinstance(value, Mapping):
        for key, item in value.items():
            record_layer(sources, f"{dotted}.{key}", name, item)


def layer_that_set(dotted: str, sources: Mapping[str, str]) -> str | None:
    """The layer that set ``dotted`` (for a key inside a list: the layer that gave the list); None
    when no layer did: it has its default (unlike ``source_of``, a section that holds it is not
    taken for it)."""
    parts = dotted.split(".")
    index = next((i for i, part in enumerate(parts) if part.isdigit()), len(parts))
    return sources.get(".".join(parts[:index]))


def source_of(dotted: str, sources: Mapping[str, str], default: str) -> str:
    """The layer that set ``dotted`` or, failing that, its nearest enclosing section."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        found = sources.get(".".join(parts[:i]))
        if found is not None:
            return found
    return default
