"""``--set dotted.key=value`` (and a command's flags that set a key): ``apply_override`` parses the
value as a file's YAML is read (``yaml_text``) and puts it into the raw mapping, refusing a key the
tree does not have."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, get_origin

import yaml
from pydantic import BaseModel

from ..errors import ConfigError
from .keys import RENAMED_KEYS
from .run_config import RunConfig
from .section_base import _section_model
from .validation import _unknown_key
from .yaml_text import RepeatedKeyError, load_yaml


def apply_override(raw: dict[str, Any], item: str, *, where: str = "--set") -> str:
    """Apply one ``dotted.key=value`` (value parsed as a YAML scalar or flow list/map, as a file's
    YAML is read: ``yaml_text``) in place; ``where``: the flag it came from (``--set``, ``--sweep``,
    ...), named by its errors. Returns the dotted key it set (a renamed key's new name)."""
    key, sep, text = item.partition("=")
    key = RENAMED_KEYS.get(key.strip(), key.strip())
    if not sep or not key:
        raise ConfigError(
            f"override {item!r} is not of the form dotted.key=value",
            where=where,
            hint=f"e.g. {where} train.lr=1e-4",
        )
    try:
        value = load_yaml(text) if text.strip() else ""
    except RepeatedKeyError as e:  # (a flow map: train={steps: 5, steps: 7})
        raise ConfigError(
            f"{key}.{e.key} is given twice in {text!r}",
            where=f"{where} {key}",
            hint=f"keep one {key}.{e.key}",
        ) from None
    except yaml.YAMLError:
        value = text
    parts = key.split(".")
    _check_known_path(parts, where=where)
    node = raw
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"{'.'.join(parts[: i + 1])} is not a section", where=f"{where} {key}")
        node = child
    node[parts[-1]] = value
    for old_name, new_name in RENAMED_KEYS.items():  # the new name set: the old one goes
        if key == new_name and parts[:-1] == old_name.split(".")[:-1]:
            node.pop(old_name.split(".")[-1], None)
    return key


def _check_known_path(parts: Sequence[str], *, where: str) -> None:
    model: type[BaseModel] | None = RunConfig
    for i, part in enumerate(parts):
        if model is None:
            # below a dict-valued field (e.g. launch.env.NAME): any key is allowed
            return
        fields = model.model_fields
        if part not in fields:
            raise _unknown_key(parts[: i + 1], list(fields), where=where)
        annotation = fields[part].annotation
        if get_origin(annotation) is dict or annotation is dict:
            return
        model = _section_model(annotation)
        if model is None and i < len(parts) - 1:
            raise ConfigError(f"{'.'.join(parts[: i + 1])} is a value, not a section", where=where)
