"""Options and helpers shared by every command group (defined once)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from ..config import RunConfig, load_config

# Piped (a file, grep, a script), lines are never broken at 80 columns: what reads them wants them
# whole. Tables are as wide as their content either way; COLUMNS still wins where it is set.
PIPED_WIDTH = 1000


def stdout_console() -> Console:
    plain = Console()
    return Console(width=PIPED_WIDTH) if not plain.is_terminal and "COLUMNS" not in os.environ else plain


console = stdout_console()
err_console = Console(stderr=True, soft_wrap=True)

CONFIG_HELP = (
    "The run's YAML config; several files are layered, later ones overriding earlier ones key by key "
    "(base.yaml exp.yaml)."
)
ConfigArg = Annotated[list[Path], typer.Argument(help=CONFIG_HELP, show_default=False, metavar="CONFIG")]
SetOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--set",
        "--override",
        help="Override a config value: dotted.key=value (repeatable). Values are YAML scalars or lists.",
        metavar="KEY=VALUE",
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Machine-readable JSON on stdout.")]
ConfigOptArg = Annotated[
    list[Path] | None, typer.Argument(help=CONFIG_HELP + " Optional with --script.", metavar="[CONFIG]")
]
ScriptOpt = Annotated[
    Path | None,
    typer.Option(
        "--script",
        help="Train your own torch script (it calls hpclaunch.attach; docs/byo.md) instead of the "
        "built-in MMDiT trainer; the script's own arguments go after --.",
        metavar="SCRIPT",
    ),
]

# What followed a literal ``--`` on the command line: the script's arguments (``main`` splits them
# off before the command's options are parsed; None: there was no ``--``).
_script_args: list[str] | None = None


def take_script_args(argv: list[str]) -> list[str]:
    """``argv`` up to a literal ``--``; what follows it is kept as the script's arguments."""
    global _script_args
    if "--" not in argv:
        _script_args = None
        return argv
    at = argv.index("--")
    _script_args = list(argv[at + 1 :])
    return argv[:at]


def script_flags(script: Path | None) -> list[tuple[str, str]]:
    """``--script`` and the arguments after ``--`` as config keys (``script.path``, ``script.args``),
    applied after every file and ``--set``."""
    flags = [(f"script.path={json.dumps(str(script))}", "--script")] if script is not None else []
    if _script_args is not None:
        flags.append((f"script.args={json.dumps(_script_args)}", "--"))
    return flags


def load_run_config(
    config: list[Path] | None,
    overrides: list[str] | None,
    script: Path | None,
    flags: list[tuple[str, str]] | None = None,
    *,
    command: str,
    run_written: bool = False,
) -> RunConfig:
    """CONFIG (optional with ``--script``: the defaults) with overrides, a command's flags and the
    script's; one line and exit 2 when there is nothing to run. ``run_written``: CONFIG is a run
    directory's own config.yaml."""
    if not config and script is None:
        from ..errors import UserInputError

        raise UserInputError(
            "give a CONFIG file or --script SCRIPT",
            where=command,
            hint=f"hpclaunch {command} examples/tiny.yaml, or hpclaunch {command} --script train.py -- --epochs 3",
        )
    return load(config or [], overrides, [*(flags or []), *script_flags(script)], run_written=run_written)


def load(
    config: Path | list[Path],
    overrides: list[str] | None,
    flags: list[tuple[str, str]] | None = None,
    *,
    run_written: bool = False,
) -> RunConfig:
    """Load and validate CONFIG (one file, or several layered) with overrides (and ``flags``: a
    command's options that set a key, applied last); relative paths resolve against the current
    directory, not the config file's. ``run_written``: CONFIG is a run directory's own."""
    return load_config(config, overrides or [], base=Path.cwd(), flags=flags or [], run_written=run_written)


def config_names(config: Path | list[Path]) -> str:
    """CONFIG as an error's ``where`` names it: ``base.yaml + exp.yaml``."""
    return " + ".join(str(c) for c in config) if isinstance(config, list) else str(config)


def command_group(name: str, help: str) -> tuple[typer.Typer, Callable[[typer.Typer], None]]:
    """A group of subcommands (``hpclaunch NAME ...``, its help with examples) and the ``register``
    that adds it to the command line."""
    group = typer.Typer(help=help, no_args_is_help=True)

    def register(app: typer.Typer) -> None:
        app.add_typer(group, name=name)

    return group, register


def print_json(obj: Any) -> None:
    """JSON for scripts: plain stdout, no rich markup or wrapping."""
    typer.echo(json.dumps(obj, indent=2, sort_keys=False, default=str))
