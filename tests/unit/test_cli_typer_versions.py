"""The CLI on typer releases with and without rich help types (the H200's image had one without)."""

from __future__ import annotations

import pytest
from typer.core import TyperArgument, TyperOption

from hpclaunch import cli

pytestmark = pytest.mark.fast


def test_help_labels_are_fixed_where_typer_has_rich_help_types() -> None:
    cli._plain_help_types()
    cli._plain_help_types()  # once is enough; twice changes nothing
    for cls in (TyperOption, TyperArgument):
        method = getattr(cls, "display_type_rich", None)
        assert method is None or getattr(method, "_hpclaunch", False)


def test_a_typer_without_rich_help_types_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    import typer.core

    class Option:  # a typer release whose parameters have no display_type_rich
        pass

    class Argument:
        pass

    monkeypatch.setattr(typer.core, "TyperOption", Option)
    monkeypatch.setattr(typer.core, "TyperArgument", Argument)
    cli._plain_help_types()  # raised AttributeError before
    assert not hasattr(Option, "display_type_rich") and not hasattr(Argument, "display_type_rich")
