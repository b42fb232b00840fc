"""README keeps the config reference in step with the schema and names its two commands."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parents[2]


def _script() -> object:
    spec = importlib.util.spec_from_file_location(
        "update_readme_reference", ROOT / "scripts" / "update_readme_reference.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_config_reference_matches_the_schema() -> None:
    script = _script()
    text = (ROOT / "README.md").read_text()
    assert script.updated(text) == text, "README config reference is stale: run `make docs`"  # type: ignore[attr-defined]


def test_readme_gives_the_two_commands() -> None:
    text = (ROOT / "README.md").read_text()
    assert "make demo" in text and "make test" in text
