"""The one typed config tree: YAML file + ``--set dotted.key=value`` overrides -> ``RunConfig``.

Every field carries its help text and bounds; every error names the dotted key, the bad value and
what is allowed. Unknown keys get a did-you-mean. Cross-field rules live on the models. This package
never imports torch: every CLI command loads configs.

Callers import from here (``from hpclaunch.config import RunConfig, load_config``); the modules, each
importing only those above it:

- ``yaml_text``: how a config's YAML is read (``true``/``false`` the only booleans, ``2:00:00``
  and ``0022`` text, a key given twice refused)
- ``section_base``: the section base (no boolean for a number, no inf/nan), value formats
  (durations, names, directive-safe values), ``KeyedValueError``
- ``keys``: keys renamed (``RENAMED_KEYS``) or retired (``RETIRED_KEYS``) since a release
- ``cluster``, ``training``, ``checkpoint``, ``runtime``: the sections, by concern
- ``rules``: the rules across sections that ``RunConfig``'s validators apply
- ``layers``: several files merged key by key, and which layer set each key
- ``run_config``: ``RunConfig``, its derived values, its paths made absolute, its hashes
- ``validation``: ``validate_config`` and the wording of its errors (did-you-mean)
- ``overrides``: ``apply_override`` (``--set`` and a command's flags)
- ``layering``: ``load_config`` and ``read_yaml_mapping``
- ``reference``: the reference table (docs/configuration.md) and the JSON schema
"""

from __future__ import annotations

from ..errors import ConfigError
from .checkpoint import CheckpointConfig, MemoryTierConfig
from .cluster import LaunchConfig, NcclConfig, NcclPreset, RescueConfig, SchedulerConfig
from .keys import RENAMED_KEYS, RETIRED_KEYS, drop_retired
from .layering import load_config, read_yaml_mapping
from .layers import merge_layers, source_of
from .overrides import apply_override
from .reference import iter_reference_rows, json_schema
from .run_config import RunConfig, omp_threads
from .runtime import (
    ContainerConfig,
    ContainerRuntime,
    FailNodeCheckKnob,
    HangKnob,
    PreflightConfig,
    ScriptConfig,
    SlowRankKnob,
    TestingConfig,
    WatchdogConfig,
)
from .section_base import (
    BUILTIN_SECTIONS,
    DIRECTIVE_VALUE_RE,
    ENV_NAME_RE,
    INTERNAL_SECTIONS,
    NAME_RE,
    KeyedValueError,
    format_hms,
    parse_duration,
)
from .training import (
    NOT_SHAPE,
    DataConfig,
    ModelConfig,
    ProfileKnob,
    TrainConfig,
    WandbConfig,
    extra_missing,
)
from .validation import validate_config

__all__ = [
    "BUILTIN_SECTIONS",
    "DIRECTIVE_VALUE_RE",
    "ENV_NAME_RE",
    "INTERNAL_SECTIONS",
    "NAME_RE",
    "NOT_SHAPE",
    "RENAMED_KEYS",
    "RETIRED_KEYS",
    "CheckpointConfig",
    "ConfigError",
    "ContainerConfig",
    "ContainerRuntime",
    "DataConfig",
    "FailNodeCheckKnob",
    "HangKnob",
    "KeyedValueError",
    "LaunchConfig",
    "MemoryTierConfig",
    "ModelConfig",
    "NcclConfig",
    "NcclPreset",
    "PreflightConfig",
    "ProfileKnob",
    "RescueConfig",
    "RunConfig",
    "SchedulerConfig",
    "ScriptConfig",
    "SlowRankKnob",
    "TestingConfig",
    "TrainConfig",
    "WandbConfig",
    "WatchdogConfig",
    "apply_override",
    "drop_retired",
    "extra_missing",
    "format_hms",
    "iter_reference_rows",
    "json_schema",
    "load_config",
    "merge_layers",
    "omp_threads",
    "parse_duration",
    "read_yaml_mapping",
    "source_of",
    "validate_config",
]
