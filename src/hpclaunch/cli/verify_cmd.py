"""``hpclaunch verify-resume``: run a script uninterrupted and interrupted, and compare every step."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Annotated

import typer

from ..errors import UserInputError
from . import common
from .common import ConfigOptArg, JsonOpt, SetOpt, console, print_json


def register(app: typer.Typer) -> None:
    app.command("verify-resume")(verify_resume)


def verify_resume(
    config: ConfigOptArg = None,
    overrides: SetOpt = None,
    script: Annotated[
        Path | None,
        typer.Option(
            "--script", help="The training script (it calls hpclaunch.attach); its arguments after --."
        ),
    ] = None,
    ranks: Annotated[int, typer.Option("--ranks", min=1, max=8, help="Ranks (gloo, this machine).")] = 2,
    only: Annotated[
        str | None, typer.Option("--only", help="Only these scenarios (comma-separated): stop, crash, ranks.")
    ] = None,
    keep: Annotated[
        Path | None, typer.Option("--keep", help="Keep the runs, their logs and traces in this folder.")
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Prove that a script resumes exactly: run it uninterrupted, stopped and resumed, crashed and
    restarted in place, and resumed on fewer ranks, on this machine's CPU, and compare every step's
    random states, every attached object and what it logged. The first difference is named with
    what usually causes it.

    Exit codes: 0 every comparison passed, 1 a difference was found, 2 bad input or a run that
    failed (its log is named).

    Examples:
      hpclaunch verify-resume --script examples/byo/gpt_ddp.py -- --steps 30
      hpclaunch verify-resume --script train.py --ranks 1 --keep verify-out -- --epochs 1
    """
    from ..orchestrator.verify_resume import SCENARIOS, VerifyPlan
    from ..orchestrator.verify_resume import verify_resume as run_verify

    if script is None:
        raise UserInputError(
            "give --script SCRIPT",
            where="verify-resume",
            hint="hpclaunch verify-resume --script train.py -- ARGS",
        )
    if not script.is_file():
        raise UserInputError(f"{script} is not a file", where="--script")
    args = common._script_args or []
    chosen = frozenset(n.strip() for n in (only or "").split(",") if n.strip())
    unknown = sorted(chosen - set(SCENARIOS))
    if unknown:
        raise UserInputError(
            f"--only {','.join(unknown)}: no such scenario",
            where="verify-resume",
            hint=f"choose from {', '.join(SCENARIOS)}",
        )
    with tempfile.TemporaryDirectory(prefix="hpclaunch-verify-") as tmp:
        work = (keep or Path(tmp)).resolve()
        plan = VerifyPlan(
            script.resolve(),
            [c.resolve() for c in config or []],
            overrides or [],
            args,
            ranks,
            work,
            only=chosen,
        )
        say = (lambda text: None) if as_json else (lambda text: console.print(text, highlight=False))
        findings = run_verify(plan, say=say)
    if as_json:
        print_json([f.__dict__ for f in findings])
    else:
        for f in findings:
            mark = "[green]pass[/]" if f.ok else "[red]FAIL[/]"
            console.print(f"{mark} {f.scenario}: {f.summary}", highlight=False, soft_wrap=True)
            if f.hint:
                console.print(f"     why, usually: {f.hint}", highlight=False, soft_wrap=True)
        if keep is not None:
            console.print(f"runs, logs and traces kept in {work}", highlight=False)
    raise typer.Exit(0 if all(f.ok for f in findings) else 1)
