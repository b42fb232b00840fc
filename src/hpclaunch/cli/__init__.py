"""The ``hpclaunch`` command line: wiring and error formatting only.

One module per command group registers its commands on the app (``register(app)``). Typed errors
raised anywhere below are formatted here, once: one line naming what and where, one hint line,
exit code 2 for bad input and 1 for a failed check or run. ``HPCLAUNCH_DEBUG=1`` shows tracebacks.
Commands that do not train never import torch (checked by a test with ``python -X importtime``).
"""

from __future__ import annotations

import errno
import os
import sys
from typing import Any

import typer

from ..errors import FilesystemError, HpclaunchError, UserInputError, debug_enabled

app = typer.Typer(
    name="hpclaunch",
    help="One YAML file to a SLURM or PBS MMDiT training run that survives time limits and preemption.",
    no_args_is_help=True,
    context_settings={"help_option_names": ["-h", "--help"]},
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)


def _version(value: bool) -> None:
    if value:
        from .. import __version__

        typer.echo(f"hpclaunch {__version__}")
        raise typer.Exit(0)


@app.callback()
def _main(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print hpclaunch's version and exit."
    ),
) -> None:
    """One YAML file to a SLURM or PBS MMDiT training run that survives time limits and preemption."""


def _plain_help_types() -> None:
    """typer labels a flag ``<bool>`` and a repeatable value ``<list[Path]>`` in help: a flag takes
    no value (no label), and a repeatable one reads ``<path>...``. Applied once, to help only."""
    import re

    from typer.core import TyperArgument, TyperOption

    for cls in (TyperOption, TyperArgument):
        original = getattr(cls, "display_type_rich", None)
        if original is None or getattr(original, "_hpclaunch", False):
            continue  # (typer releases without rich help types label nothing to fix)

        def display(self: Any, ctx: Any, _original: Any = original) -> str | None:
            if getattr(self, "is_flag", False):
                return None
            shown = _original(self, ctx)
            if isinstance(shown, str):
                shown = re.sub(r"<list\[(\w+)\]>", lambda m: f"<{m.group(1).lower()}>...", shown)
            return shown

        display._hpclaunch = True  # type: ignore[attr-defined]
        cls.display_type_rich = display  # type: ignore[method-assign]


_command: Any = None  # the click command built from ``app``, once per process


def command() -> Any:
    """The command line as one click command: every group registered and built once (typer rebuilds
    the whole tree from the functions' annotations at every call, and a second ``add_typer`` of a
    group would list it twice)."""
    global _command
    if _command is None:
        _register_all()
        _command = typer.main.get_command(app)
    return _command


def _register_all() -> None:
    _plain_help_types()

    for name in (
        "config_cmd",
        "render_cmd",
        "run_cmd",
        "preflight_cmd",
        "nccl_cmd",
        "data_cmd",
        "report_cmd",
        "sample_cmd",
        "verify_cmd",
    ):
        __import__(f"{__name__}.{name}", fromlist=["register"]).register(app)


def report_error(err: HpclaunchError) -> int:
    """Print ``hpclaunch: error: <where>: <what>`` and a hint; return the exit code."""
    from .common import err_console

    err_console.print(f"[bold red]hpclaunch: error:[/] {_escape(err.one_line())}", highlight=False)
    if err.hint:
        err_console.print(f"  hint: {_escape(err.hint)}", highlight=False)
    return err.exit_code


def _escape(text: str) -> str:
    from rich.markup import escape

    return escape(text)


def filesystem_refusal(err: OSError) -> HpclaunchError | None:
    """A place the command must write that the filesystem refuses (read-only, no permission: bad
    input, exit 2; full: exit 1) as one line; None for any other OSError, or one that names no file
    (a signal to another user's process: not a place to write), which keeps its traceback."""
    if not err.filename:
        return None
    where = str(err.filename)
    if err.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return UserInputError(
            f"cannot write here: {err.strerror}",
            where=where,
            hint="run it where you can write (run_dir, or a copy of the run), or fix the permissions",
        )
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        return FilesystemError(
            f"cannot write here: {err.strerror}",
            where=where,
            hint="free space there, or use another filesystem",
        )
    return None


def main(argv: list[str] | None = None) -> int:
    from .common import take_script_args

    try:
        # (everything after a literal `--` is the script's: its own options must not reach ours)
        args = take_script_args(list(sys.argv[1:] if argv is None else argv))
        # (not standalone: a usage error comes here, to be said in one line like every other)
        code = command()(args=args, prog_name="hpclaunch", standalone_mode=False)
        return code if isinstance(code, int) else 0
    except HpclaunchError as err:
        if debug_enabled():
            raise
        return report_error(err)
    except OSError as err:
        if err.errno == errno.EPIPE:  # (`hpclaunch status | head`: the reader left)
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (flushed at exit, into nothing)
            return 1
        unwritable = filesystem_refusal(err)
        if unwritable is None or debug_enabled():
            raise
        return report_error(unwritable)
    except SystemExit as e:
        return int(e.code or 0) if not isinstance(e.code, str) else 1
    except KeyboardInterrupt:
        return 130
    except Exception as err:
        said = usage_error(err)
        if said is None:
            raise
        return said


def usage_error(err: Exception) -> int | None:
    """The command line's own errors (click's, as typer carries them: a missing argument, an
    unknown option) in one line and a hint, as every other error is said; None for anything else."""
    kinds = {c.__name__ for c in type(err).__mro__}
    if "Abort" in kinds:
        print("Aborted!", file=sys.stderr)
        return 1
    if "ClickException" not in kinds:
        return None
    ctx = getattr(err, "ctx", None)
    if "NoArgsIsHelpError" in kinds and ctx is not None:  # `hpclaunch data`: its help, as before
        print(ctx.get_help())
        return 2
    path = str(getattr(ctx, "command_path", "") or "hpclaunch")
    where = path.removeprefix("hpclaunch").strip() or None
    said = UserInputError(str(err.format_message()).rstrip("."), where=where, hint=f"{path} -h")  # type: ignore[attr-defined]
    said.exit_code = int(getattr(err, "exit_code", 2))
    return report_error(said)


def entrypoint() -> None:
    sys.exit(main())
