"""README is the front door (at most 200 lines, its commands, a link to every docs page) and the
config reference in docs/configuration.md is in step with the schema."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


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
    page = DOCS / "configuration.md"
    assert page == script.PAGE, "`make docs` must write the reference page"  # type: ignore[attr-defined]
    text = page.read_text()
    assert script.updated(text) == text, "docs/configuration.md is stale: run `make docs`"  # type: ignore[attr-defined]


def test_readme_gives_the_commands() -> None:
    text = (ROOT / "README.md").read_text()
    for command in (
        "make demo",
        "make test",
        "make check",
        ".venv/bin/hpclaunch",
        "source .venv/bin/activate",
    ):
        assert command in text, command


def test_readme_is_a_front_door_that_links_every_docs_page() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    linked = set(re.findall(r"\]\((docs/[^)#]+)\)", text))
    assert {f"docs/{p.name}" for p in DOCS.glob("*.md")} <= linked


@pytest.mark.parametrize("page", [ROOT / "README.md", *sorted(DOCS.glob("*.md"))], ids=lambda p: p.name)
def test_every_relative_link_resolves(page: Path) -> None:
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
        if "://" not in target:
            assert (page.parent / target).exists(), f"{page.name} links {target}"
