"""Loading: ``load_config`` reads the CONFIG files (``read_yaml_mapping``), layers them, applies
``--set`` and a command's flags, validates once and resolves the paths."""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from ..errors import ConfigError
from .keys import drop_retired
from .layers import merge_layers, record_layer
from .overrides import apply_override
from .run_config import RunConfig
from .validation import validate_config
from .yaml_text import RepeatedKeyError, load_yaml


def load_config(
    path: str | Path | Sequence[str | Path] | None,
    overrides: Sequence[str] = (),
    *,
    base: Path | None = None,
    flags: Sequence[tuple[str, str]] = (),
    run_written: bool = False,
) -> RunConfig:
    """Read ``path`` (None = defaults; several files: layered, see ``merge_layers``), apply
    overrides, then ``flags`` (``(key=value, flag)``: a command's own options that set a key, such as
    ``render --scheduler``), validate once; paths resolved against ``base``. An error names the file
    (or ``--set``, or the flag) that set the bad key. ``run_written``: ``path`` is a run directory's
    own config.yaml (an older version may have written keys removed since: ``RETIRED_KEYS``)."""
    files = [] if path is None else [path] if isinstance(path, (str, Path)) else list(path)
    raw, sources = merge_layers([(str(f), _settings_in(Path(f))) for f in files])
    if run_written:
        drop_retired(raw)
    for item, flag in [*((o, "--set") for o in overrides), *flags]:
        key = apply_override(raw, item, where=flag)
        record_layer(sources, key, flag, _value_at(raw, key))
    where = " + ".join(str(f) for f in files) or "defaults"
    cfg = validate_config(raw, where=where, sources=sources)
    return cfg.resolved(base) if base is not None else cfg


def _value_at(raw: dict[str, Any], dotted: str) -> Any:
    value: Any = raw
    for part in dotted.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def _a_directory(path: Path) -> ConfigError:
    """CONFIG named a directory: a run's (it has its config.yaml) or some other."""
    if (path / "config.yaml").is_file():
        return ConfigError(
            "a run directory, not a CONFIG file",
            where=str(path),
            hint=f"continue that run: hpclaunch submit --resume {path}, or in the foreground: "
            f"hpclaunch train {path} --resume (the config it was started with)",
        )
    return ConfigError("a directory, not a CONFIG file", where=str(path), hint="name the run's YAML file")


def _settings_in(path: Path) -> dict[str, Any]:
    """A CONFIG file's settings; an empty one (or only comments) is refused: it would run on every
    default without a word, which is never what a file named on the command line meant."""
    data = read_yaml_mapping(path)
    if not data:
        raise ConfigError(
            "holds no settings (it is empty, or only comments): every key would take its default",
            where=str(path),
            hint=f"write one with every key: hpclaunch init {path} --force; or name the file you meant",
        )
    return data


def read_yaml_mapping(path: Path) -> dict[str, Any]:
    """A config file's mapping (read as ``yaml_text`` says); a section left empty (``train:``, all
    of its keys deleted as the init template invites) reads as an empty one: every default."""
    try:
        data = load_yaml(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(
            "config file not found",
            where=str(path),
            hint="check the path, or create one with 'hpclaunch init'",
        ) from None
    except IsADirectoryError:
        raise _a_directory(path) from None
    except OSError as e:
        raise ConfigError(f"cannot read config file ({e.strerror})", where=str(path)) from None
    except UnicodeDecodeError as e:
        raise _not_utf8(path, e) from None
    except RepeatedKeyError as e:
        mark = e.problem_mark
        raise ConfigError(
            f"{e.key} is given twice in one mapping (first on line {e.first_line}); the last would "
            "silently win",
            where=f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path),
            hint=f"keep one {e.key}: delete the line you do not mean",
        ) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        loc = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"not valid YAML ({problem})", where=loc, hint="fix the YAML syntax") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"the top level must be a mapping of sections, not a {type(data).__name__}",
            where=str(path),
        )
    return _empty_sections_as_mappings(data, RunConfig)


def _not_utf8(path: Path, e: UnicodeDecodeError) -> ConfigError:
    data = e.object if isinstance(e.object, bytes) else b""
    line = data.count(b"\n", 0, e.start) + 1
    utf16 = data.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE))
    return ConfigError(
        f"not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}, line {line})",
        where=str(path),
        hint="save the file as UTF-8"
        + (" (it is UTF-16, which some Windows editors call 'Unicode')" if utf16 else ""),
    )


def _empty_sections_as_mappings(data: dict[str, Any], model: type[BaseModel]) -> dict[str, Any]:
    """``data`` with each null that stands for a section that is always there (``train:``,
    ``checkpoint.memory:``) an empty mapping. An optional section's null (``train.profile``) means
    off and stays."""
    out = dict(data)
    for key, value in data.items():
        field = model.model_fields.get(str(key))
        section = field.annotation if field is not None else None
        if not (isinstance(section, type) and issubclass(section, BaseModel)):
            continue  # a value, an optional section or an unknown key: validation says what it is
        if value is None:
            out[key] = {}
        elif isinstance(value, dict):
            out[key] = _empty_sections_as_mappings(value, section)
    return out
