"""Readers of the run's own files: the config it runs with, a sweep's points, the run's paths."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..config import RunConfig, apply_override, drop_retired, read_yaml_mapping, validate_config
from .paths import RunPaths


def read_config(paths: RunPaths, overrides: list[str] | None = None) -> RunConfig:
    """``RUN/config.yaml`` (plus ``overrides``), validated like any config."""
    raw = drop_retired(read_yaml_mapping(paths.config))  # (written by an older version: its keys)
    sources: dict[str, str] = {}
    for item in overrides or []:
        sources[apply_override(raw, item)] = "--set"
    return validate_config(raw, where=str(paths.config), sources=sources)


def read_sweep(paths: RunPaths) -> list[dict[str, Any]]:
    """The points of a sweep rooted at ``paths`` (each with ``run_dir``); [] when it is not one."""
    try:
        data = json.loads(paths.sweep.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return []
    points = data.get("points") if isinstance(data, dict) else None
    return [p for p in points if isinstance(p, dict) and "run_dir" in p] if isinstance(points, list) else []


def sweep_roots(paths: RunPaths) -> list[Path]:
    return [Path(p["run_dir"]) for p in read_sweep(paths)]
