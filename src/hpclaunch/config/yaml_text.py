"""How a config's YAML text is read (a CONFIG file, a ``--set`` value): ``load_yaml``.

PyYAML reads YAML 1.1, which turns text a config means literally into something else: ``yes``,
``no``, ``on`` and ``off`` into booleans (``launch.env: {A: yes}`` exported ``A=true``), ``2:00:00``
into the number 7200 (``scheduler.time_limit`` then said "7200 has no unit"), ``0022`` into 18 and
``2024-01-01`` into a date. Here a plain scalar is a boolean only when it is ``true`` or ``false``
and a number only when it is written as a decimal (as in YAML 1.2); anything else stays the text
that was written, so an environment value or a script argument keeps it, and a field that wants a
boolean or a number parses the text itself (``async_save: yes`` still reads as true). A key given
twice in one mapping is refused (``RepeatedKeyError``): PyYAML keeps the last without a word.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

_BOOL, _INT, _FLOAT = (f"tag:yaml.org,2002:{t}" for t in ("bool", "int", "float"))
# YAML 1.1's readings a config never means: bool (yes/no/on/off), int (octal, hex, binary,
# sexagesimal), float (sexagesimal), timestamp, and the ``=`` value key PyYAML cannot even construct.
_DROPPED = (_BOOL, _INT, _FLOAT, "tag:yaml.org,2002:timestamp", "tag:yaml.org,2002:value")


class _ConfigLoader(yaml.SafeLoader):
    def construct_document(self, node: yaml.Node) -> Any:
        _refuse_repeated_keys(node, [], set())
        return super().construct_document(node)


_ConfigLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag not in _DROPPED]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_ConfigLoader.add_implicit_resolver(
    _BOOL, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)
_ConfigLoader.add_implicit_resolver(_INT, re.compile(r"^[-+]?(?:0|[1-9][0-9_]*)$"), list("-+0123456789"))
_ConfigLoader.add_implicit_resolver(
    _FLOAT,
    re.compile(
        r"^(?:[-+]?[0-9][0-9_]*\.[0-9_]*(?:[eE][-+][0-9]+)?|\.[0-9][0-9_]*(?:[eE][-+][0-9]+)?"
        r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"  # YAML 1.1's, less its sexagesimal form
    ),
    list("-+0123456789."),
)


class RepeatedKeyError(yaml.MarkedYAMLError):
    """``key`` (dotted, from the document's top) is given twice in one mapping; ``problem_mark`` is
    the second occurrence, ``first_line`` (1-based) the first's."""

    def __init__(self, key: str, first: yaml.Mark, second: yaml.Mark):
        super().__init__(
            problem=f"{key} is given twice (first on line {first.line + 1})", problem_mark=second
        )
        self.key = key
        self.first_line = first.line + 1


def _refuse_repeated_keys(node: yaml.Node, path: list[str], seen: set[int]) -> None:
    if id(node) in seen:  # (an alias: its node was checked where it was anchored)
        return
    seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        first: dict[str, yaml.Node] = {}
        for key_node, value_node in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                name = str(key_node.value)
                if name in first:
                    raise RepeatedKeyError(
                        ".".join([*path, name]), first[name].start_mark, key_node.start_mark
                    )
                first[name] = key_node
                _refuse_repeated_keys(value_node, [*path, name], seen)
            else:
                _refuse_repeated_keys(value_node, path, seen)
    elif isinstance(node, yaml.SequenceNode):
        for item in node.value:  # (a list's entries are named by the list's key, as errors do)
            _refuse_repeated_keys(item, path, seen)


def load_yaml(text: str) -> Any:
    """``text`` read as a config reads YAML (module docstring); ``yaml.YAMLError`` when it is not
    YAML, ``RepeatedKeyError`` (one of them) when a mapping gives a key twice."""
    return yaml.load(text, Loader=_ConfigLoader)
