"""``hpclaunch init`` and ``hpclaunch config show|schema``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from ..config import iter_reference_rows, json_schema
from ..errors import UserInputError
from ..fsutil import atomic_write_text
from .common import ConfigArg, JsonOpt, SetOpt, command_group, console, load, print_json

config_app, _register_group = command_group(
    "config",
    "Show the resolved config or its JSON Schema.\n\nExamples:\n"
    "  hpclaunch config show examples/tiny.yaml --set train.lr=1e-4\n"
    "  hpclaunch config show base.yaml exp.yaml --json\n"
    "  hpclaunch config schema --markdown",
)


def register(app: typer.Typer) -> None:
    app.command("init")(init)
    _register_group(app)


def init(
    path: Annotated[Path, typer.Argument(help="Where to write the example config.")] = Path("hpclaunch.yaml"),
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing file.")] = False,
) -> None:
    """Write a commented example config (every key, its default and what it does).

    Example: hpclaunch init run.yaml && hpclaunch render run.yaml --scheduler slurm
    """
    if path.exists() and not force:
        raise UserInputError(f"{path} exists", where="init", hint="pass --force to overwrite it")
    if not path.parent.is_dir():  # a typo in the folder must not become a tree of new folders
        raise UserInputError(
            f"folder {path.parent} does not exist; nothing was written",
            where="init",
            hint=f"create it first (mkdir -p {path.parent}), or write the config elsewhere",
        )
    atomic_write_text(path, commented_example())
    console.print(f"wrote {path}; next: hpclaunch preflight {path}")


@config_app.command("show")
def show(config: ConfigArg, overrides: SetOpt = None, as_json: JsonOpt = False) -> None:
    """Print the resolved config (defaults filled in, overrides applied, paths absolute).

    Example: hpclaunch config show examples/tiny.yaml --set train.lr=1e-4
    """
    import yaml

    from ..config import INTERNAL_SECTIONS, RunConfig

    cfg = load(config, overrides)
    data = cfg.to_dict()
    defaults = RunConfig.model_validate({}).to_dict()
    for name in INTERNAL_SECTIONS:  # the test knobs, shown only when a config sets one
        if data.get(name) == defaults.get(name):
            data.pop(name, None)
    if as_json:
        print_json(data)
    else:  # block style throughout, as `init` writes it
        typer.echo(yaml.safe_dump(data, sort_keys=False, default_flow_style=False), nl=False)


@config_app.command("schema")
def schema(
    markdown: Annotated[
        bool,
        typer.Option("--markdown", help="The config reference table (as in docs/configuration.md) instead."),
    ] = False,
) -> None:
    """Print the config's JSON Schema (or the Markdown reference table).

    Example: hpclaunch config schema > hpclaunch.schema.json
    """
    if markdown:
        typer.echo(reference_markdown(), nl=False)
    else:
        typer.echo(json.dumps(json_schema(), indent=2))


def reference_markdown() -> str:
    lines = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for key, type_name, default, description in iter_reference_rows():
        lines.append(f"| `{key}` | {type_name} | `{default}` | {description} |")
    return "\n".join(lines) + "\n"


def _optional_sections() -> list[str]:
    """Dotted keys of the optional sections (rows typed ``section | null``)."""
    return [key for key, type_name, _, _ in iter_reference_rows() if type_name.startswith("section")]


# Keys whose default a rule computes from other keys (train.warmup_steps: 10, less for a short run).
# The template leaves them out: a value written there would be pinned, and `--set train.steps=5` on
# the config `init` wrote was refused (warmup 10 not below 5).
_DEFAULT_FOLLOWS_OTHER_KEYS = ("train.warmup_steps",)


def commented_example() -> str:
    """Every key with its default, each preceded by its description as a comment (a key whose
    default follows other keys commented out)."""
    out = ["# hpclaunch run config. Every key is shown with its default; delete what you do not change.", ""]
    section, subsection = None, None
    optional = set(_optional_sections())
    for key, _type, default, description in iter_reference_rows():
        parts = key.split(".")
        if len(parts) == 1:
            out.append(f"# {description}")
            out.append(f"{key}: {default if default != 'null' else 'null'}")
            continue
        if parts[0] != section:
            section, subsection = parts[0], None
            out += ["", f"{section}:"]
        if len(parts) > 2 and ".".join(parts[:2]) in optional:
            # a key of an optional section (off by default): shown commented out under its own row
            out.append(f"  #   {parts[2]}: {default}  # {description}")
            continue
        if len(parts) > 2:  # a nested section that is always there (checkpoint.memory): its header,
            if parts[1] != subsection:  # so that uncommenting a key sets it there, not one level up
                subsection = parts[1]
                out.append(f"  {subsection}:")
            out.append(f"    # {description}")
            out.append(f"    {parts[2]}: {default}")
            continue
        out.append(f"  # {description}")
        if default == "null" and key.endswith(tuple(_optional_sections())):
            out.append(f"  # {parts[1]}:   (a mapping with these keys turns it on)")
        if key in _DEFAULT_FOLLOWS_OTHER_KEYS:  # commented out: written, it would stop following them
            out.append(f"  # {parts[1]}: {default}")
            continue
        out.append(f"  {parts[1]}: {default}")
    return "\n".join(out) + "\n"
