"""The arrows between hpclaunch's packages point one way (docs/design.md, "Layers"), and no two
files import each other, inside a package too.

Read from the source (every ``import`` and ``from ... import``, function-level ones included), so a
lazy import inside a function cannot hide an arrow that points the wrong way.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

SRC = Path(__file__).resolve().parents[2] / "src" / "hpclaunch"

# What each part may import (besides itself). Top-level modules count as parts of their own.
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "fsutil": set(),
    "proc": set(),
    "estimate": set(),
    # The probe's JSON, which the trainer's scripts write and preflight reads (neither may import
    # the other): declared once, below both.
    "probe_shapes": {"fsutil"},
    "nccl": {"errors"},
    "config": {"errors", "nccl"},
    "modelmath": {"config"},
    # The LR of every step and what a resume changes of it: the trainer's rule, which submit and
    # status compute too (without torch).
    "lr_schedule": {"config"},
    "rundir": {"config", "errors", "fsutil"},
    "shards": {"config", "errors", "fsutil"},
    "templates": {"config", "errors", "rundir"},
    "schedulers": {"config", "errors", "fsutil", "proc", "rundir", "templates"},
    "preflight": {
        "config",
        "errors",
        "estimate",
        "fsutil",
        "modelmath",
        "nccl",
        "proc",
        "probe_shapes",
        "rundir",
        "schedulers",
        "shards",
    },
    # What every rank runs around its steps (the built-in trainer's and a user's script alike).
    "rank": {"config", "errors", "fsutil", "rundir"},
    "jobs": {"config", "errors", "fsutil", "nccl", "preflight", "proc", "rank", "rundir", "schedulers"},
    "trainer": {
        "config",
        "errors",
        "fsutil",
        "lr_schedule",
        "modelmath",
        "probe_shapes",
        "rank",
        "rundir",
        "shards",
    },
    "orchestrator": {
        "config",
        "errors",
        "estimate",
        "fsutil",
        "lr_schedule",
        "modelmath",
        "nccl",
        "preflight",
        "rundir",
        "schedulers",
        "shards",  # (the data a run is refused for, before anything is written)
        "templates",
    },
    "cli": {"*"},
}
# The node agent starts the rank host with the helpers' signal policy, and uses nothing else of the
# rank side (it starts the rank host by module name).
JOBS_FROM_RANK = {"hpclaunch.rank.helper_signals"}
# The orchestrator plans with preflight's sizes (the save time in the stop lead), nothing else of it.
ORCHESTRATOR_FROM_PREFLIGHT = {"hpclaunch.preflight.sizes"}


def part_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "hpclaunch" or len(parts) < 2:
        return None
    return parts[1]


def module_name(path: Path, root: Path = SRC) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imports_of(path: Path) -> set[str]:
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            found.add(target)
            found.update(f"{target}.{a.name}" for a in node.names)  # `from .. import nccl`
    return {m for m in found if m.startswith("hpclaunch")}


SOURCES = sorted(SRC.rglob("*.py"))


@pytest.mark.parametrize("path", SOURCES, ids=[str(p.relative_to(SRC)) for p in SOURCES])
def test_imports_point_down(path: Path) -> None:
    me = part_of(module_name(path))
    if me is None or me in ("__main__",) or "*" in ALLOWED.get(me, set()):
        return
    assert me in ALLOWED, f"{me} has no place in the layers; add it to ALLOWED and docs/design.md"
    for target in imports_of(path):
        other = part_of(target)
        if other is None or other == me or other not in ALLOWED:
            continue
        assert other in ALLOWED[me], f"{module_name(path)} imports {target}: {me} -> {other} points up"
        if me == "jobs" and other == "rank":
            assert any(target.startswith(t) for t in JOBS_FROM_RANK), f"{module_name(path)} imports {target}"
        if me == "orchestrator" and other == "preflight":
            assert any(target.startswith(t) for t in ORCHESTRATOR_FROM_PREFLIGHT), (
                f"{module_name(path)} imports {target}"
            )


def test_the_scheduler_protocol_imports_no_scheduler() -> None:
    """``schedulers.protocol`` is what the three scheduler modules build on; the registry that picks
    one sits above them (``schedulers.registry``), so no circle runs through ``protocol``."""
    base = SRC / "schedulers" / "protocol.py"
    assert base.exists()
    siblings = {"hpclaunch.schedulers.slurm", "hpclaunch.schedulers.pbs", "hpclaunch.schedulers.local"}
    assert not {t for t in imports_of(base) if any(t.startswith(s) for s in siblings)}


def test_there_is_no_cycle_between_parts() -> None:
    edges: dict[str, set[str]] = {}
    for path in SOURCES:
        me = part_of(module_name(path))
        if me is None:
            continue
        for target in imports_of(path):
            other = part_of(target)
            if other and other != me and other in ALLOWED:
                edges.setdefault(me, set()).add(other)

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        for nxt in edges.get(start, set()):
            if nxt == goal or (nxt not in seen and reaches(nxt, goal, seen | {nxt})):
                return True
        return False

    cycles = sorted(p for p in edges if reaches(p, p, {p}))
    assert cycles == [], f"import cycle through {cycles}"


def file_edges(root: Path) -> dict[str, set[str]]:
    """Which module file imports which, for every file under ``root`` (a package directory).

    ``from . import channel`` is an arrow to ``channel``, not to the package's ``__init__``; a name
    imported from a package (``from ...rundir import Ledger``) is an arrow to its ``__init__``.
    Imports inside functions and under ``TYPE_CHECKING`` count: a lazy import hides a circle from
    the interpreter, not from a reader."""
    files = sorted(root.rglob("*.py"))
    modules = {module_name(p, root) for p in files}

    def known(target: str) -> str | None:
        while target and target not in modules:
            target = target.rpartition(".")[0]
        return target or None

    edges: dict[str, set[str]] = {}
    for path in files:
        me = module_name(path, root)
        package = me if path.name == "__init__.py" else me.rsplit(".", 1)[0]
        found: set[str | None] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(known(a.name) for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    target = ".".join([*base, node.module] if node.module else base)
                else:
                    target = node.module or ""
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    found.add(sub if sub in modules else known(target))
        edges[me] = {m for m in found if m is not None and m != me}
    return edges


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every set of modules that reach one another (Tarjan's strongly connected components with
    more than one member), each sorted, for the message."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(found)


def test_no_two_files_import_each_other() -> None:
    found = circles(file_edges(SRC))
    assert found == [], f"import circle between files (docs/design.md, Layers): {found}"


def test_a_lazy_import_circle_inside_a_package_is_found(tmp_path: Path) -> None:
    """The circle this test was written for: ``background`` imported ``set_thread_nice`` from
    ``checkpointer`` inside a function while ``checkpointer`` imported ``background``."""
    pkg = tmp_path / "hpclaunch" / "ckpt"
    pkg.mkdir(parents=True)
    (tmp_path / "hpclaunch" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("from .checkpointer import Checkpointer\n")
    (pkg / "channel.py").write_text("")
    (pkg / "checkpointer.py").write_text("from .background import agree\nclass Checkpointer: ...\n")
    (pkg / "background.py").write_text(
        "from . import channel\ndef agree():\n    from .checkpointer import nice\n"
    )
    root = tmp_path / "hpclaunch"
    assert circles(file_edges(root)) == [["hpclaunch.ckpt.background", "hpclaunch.ckpt.checkpointer"]]
    (pkg / "background.py").write_text("from . import channel\ndef agree(): ...\n")
    assert circles(file_edges(root)) == []
