"""Issue 47's sizes, held: no module in src over 600 lines and no class over 300, so that a module
or a class that grows past them is split when it grows, not found later (status.py passed 600 once
unseen)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

SRC = Path(__file__).resolve().parents[2] / "src" / "hpclaunch"


def test_no_module_over_600_lines_and_no_class_over_300() -> None:
    too_long: list[str] = []
    for path in sorted(SRC.rglob("*.py")):
        text = path.read_text()
        lines = len(text.splitlines())
        if lines > 600:
            too_long.append(f"{path.relative_to(SRC)}: {lines} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and (size := (node.end_lineno or 0) - node.lineno + 1) > 300:
                too_long.append(f"{path.relative_to(SRC)}: class {node.name} {size} lines")
    assert not too_long, too_long
