"""Readers of the run's own files: the config it runs with, a sweep's points, and what a directory
named as a run holds (``what_is_at``): one run, a sweep's root, a sweep's point, or no run.

A sweep's root (``sweep.json``) trains nothing itself: its points do, each a run directory of its
own listed in the root's ``sweep.json``. Commands that take a run directory ask ``what_is_at``
first, so one that cannot apply to what it found says what it found (and never turns one kind into
another: a ``--resume`` that would make a run a sweep, or train a run in a sweep's root).
"""

from __future__ import annotations

import enum
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..config import RunConfig, apply_override, drop_retired, read_yaml_mapping, validate_config
from .events import Event, Resumed, of_kind
from .paths import RunPaths


def read_config(paths: RunPaths, overrides: list[str] | None = None) -> RunConfig:
    """``RUN/config.yaml`` (plus ``overrides``), validated like any config; its ``run_dir`` is where
    the run is now (a run moved or copied is read, and resumed, there)."""
    raw = drop_retired(read_yaml_mapping(paths.config))  # (written by an older version: its keys)
    raw["run_dir"] = str(paths.root.resolve())
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


class RunKind(enum.Enum):
    RUN = "run"
    SWEEP = "sweep"  # a sweep's root
    POINT = "point"  # one point of a sweep
    NONE = "none"  # no run here (nothing, a file, a directory that is no run)


@dataclass(frozen=True)
class Found:
    path: Path
    kind: RunKind
    points: list[Path] = field(default_factory=list)  # a sweep's points, in order
    sweep: Path | None = None  # a point's sweep root
    missing: bool = False  # NONE: there is nothing at all at ``path``

    def describe(self) -> str:
        """What is there, in words, for an error's line."""
        if self.kind is RunKind.SWEEP:
            names = ", ".join(p.name for p in self.points[:4]) + (", ..." if len(self.points) > 4 else "")
            return f"{self.path} is a sweep of {len(self.points)} points ({names}), not one run"
        if self.kind is RunKind.POINT:
            return f"{self.path} is point {self.path.name} of the sweep {self.sweep}"
        if self.kind is RunKind.RUN:
            return f"{self.path} is a run"
        if self.missing:
            return f"{self.path} does not exist"
        if self.path.is_file():
            return f"{self.path} is a file, not a run directory"
        return f"{self.path} is not an hpclaunch run directory (no plan.json or events/)"


def what_is_at(path: Path) -> Found:
    root = path.resolve()
    paths = RunPaths(root)
    if not paths.is_run():
        return Found(root, RunKind.NONE, missing=not root.exists())
    points = sweep_roots(paths)
    if points:
        return Found(root, RunKind.SWEEP, points=points)
    parent = RunPaths(root.parent)
    if any(Path(p).resolve() == root for p in sweep_roots(parent)):
        return Found(root, RunKind.POINT, sweep=parent.root)
    return Found(root, RunKind.RUN)


def read_total_steps(paths: RunPaths, events: Sequence[Event] = ()) -> int | None:
    """The steps the run trains to: what its newest attempt said (a script's ``run.steps(total)``),
    else the config's ``train.steps``."""
    said = [e.total_steps for e in of_kind(events, Resumed) if e.total_steps is not None]
    if said:
        return said[-1]
    try:
        data = yaml.safe_load(paths.config.read_text()) or {}
        return int(data.get("train", {}).get("steps"))
    except (FileNotFoundError, TypeError, ValueError, AttributeError, yaml.YAMLError):
        return None
