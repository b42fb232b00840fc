"""``hpclaunch submit | train | status``: a run's life cycle (``stop``, ``cancel``: stop_cmd; ``logs``: logs_cmd)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ..errors import PreflightFailed, UserInputError
from ..orchestrator.checkpoint_interval import advice as interval_advice
from ..orchestrator.checkpoint_interval import describe as describe_interval
from ..orchestrator.memory_tier_view import describe_memory_tier
from ..orchestrator.status import StatusView, steps_text
from ..orchestrator.stragglers import describe as describe_stragglers
from ..orchestrator.write_failures import describe_experiment_logs, describe_failed_saves
from ..rundir import RunPaths
from ..rundir.readers import sweep_roots
from ..templates.shell import quote
from .common import (
    ConfigOptArg,
    JsonOpt,
    ScriptOpt,
    SetOpt,
    console,
    err_console,
    load_run_config,
    print_json,
    script_flags,
)
from .run_dirs import found, refuse_sweep_with_resume, resumable, run_paths
from .views import busy as _busy
from .views import ended_code, ended_line, status_view

if TYPE_CHECKING:
    from ..config import RunConfig

RunArg = Annotated[Path, typer.Argument(help="The run directory (runs/<name>).", metavar="RUN")]


def register(app: typer.Typer) -> None:
    from .logs_cmd import logs
    from .stop_cmd import cancel, stop

    app.command("submit")(submit)
    app.command("train")(train)
    app.command("status")(status)
    app.command("stop")(stop)
    app.command("cancel")(cancel)
    app.command("logs")(logs)


def _preflight_or_refuse(cfg: RunConfig) -> None:
    """``submit``'s login preflight: its table on stderr and PreflightFailed when a check fails."""
    from ..preflight import run_login_checks

    report = run_login_checks(cfg)
    if report.failed:
        from ..preflight.results import print_report

        print_report(report, console=err_console)
        first = next(c for c in report.checks if c.status == "fail")
        raise PreflightFailed(
            f"preflight check '{first.name}' failed: {first.finding}; nothing was submitted",
            where="submit",
            hint=first.hint or "fix it, or submit with --no-preflight to skip the checks",
        )


def submit(
    config: ConfigOptArg = None,
    overrides: SetOpt = None,
    script: ScriptOpt = None,
    resume: Annotated[
        Path | None,
        typer.Option("--resume", help="Continue this existing run (its config + --set).", metavar="RUN"),
    ] = None,
    sweep: Annotated[
        list[str] | None,
        typer.Option("--sweep", help="One job array over key=v1,v2 (repeatable: cartesian product)."),
    ] = None,
    wait: Annotated[
        bool, typer.Option("--wait", help="Wait until the run ends, then print its status.")
    ] = False,
    no_preflight: Annotated[
        bool, typer.Option("--no-preflight", help="Skip the preflight checks (recorded).")
    ] = False,
    after: Annotated[
        Path | None,
        typer.Option(
            "--after",
            help="Start only once this run has finished (held until then; never if it fails or is cancelled).",
            metavar="RUN",
        ),
    ] = None,
) -> None:
    """Check, render and submit a run to its scheduler (local by default).

    Exit codes: 0 submitted (with --wait: the run finished, or stopped or was cancelled: the last line
    says which), 1 a preflight check failed (nothing submitted) or, with --wait, the run failed or was
    lost, 2 bad input or a run that cannot be resumed now (nothing written), 130 Ctrl-C while waiting
    (the run goes on).

    Examples:
      hpclaunch submit examples/tiny.yaml --wait
      hpclaunch submit --script train.py cluster.yaml -- --lr 3e-4
      hpclaunch submit base.yaml exp-highres.yaml --set train.lr=1e-4
      hpclaunch submit run.yaml --sweep train.lr=1e-4,3e-4 --sweep model.depth=2,4
      hpclaunch submit --resume runs/tiny
      hpclaunch submit stage2.yaml --after runs/stage1
    """
    # The login flow, imported by the two commands that take it: status, the most called, need not.
    from ..orchestrator.login_flow import plan_submit, resumed_config, settle_chain, submit_planned

    if resume is not None and config:
        raise UserInputError(
            f"--resume continues {resume} with the config it was started with; "
            f"{', '.join(map(str, config))} would be ignored",
            where="submit",
            hint=f"drop the CONFIG and change settings with --set (hpclaunch submit --resume {quote(resume)} "
            "--set train.steps=N), or submit the CONFIG as a new run without --resume",
        )
    refuse_sweep_with_resume(resume, sweep)
    resumed = None
    if resume is not None:
        resumed = resumable(resume)
        more = [*(overrides or []), *(k for k, _ in script_flags(script))]
        cfg = resumed_config(resumed, more, status_view)
    elif config or script is not None:
        cfg = load_run_config(config, overrides, script, command="submit")
    else:
        raise UserInputError(
            "give a CONFIG file, --script SCRIPT or --resume RUN",
            where="submit",
            hint="hpclaunch submit examples/tiny.yaml, or hpclaunch submit --script train.py",
        )
    planned = plan_submit(cfg, sweeps=sweep or [], resume=resumed)
    for warning in planned.warnings:
        err_console.print(f"[yellow]warning:[/] {warning}", highlight=False)
    submitted = submit_planned(planned, after=after, preflight=None if no_preflight else _preflight_or_refuse)
    paths = submitted.paths
    typer.echo(
        f"submitted {cfg.name} as {submitted.scheduler} job {submitted.job_id}; run directory {paths.root}"
    )
    if planned.change is not None:
        typer.echo(f"  {planned.change.line()}")
    if submitted.after is not None and (verdict := settle_chain(submitted)) is not None:
        typer.echo(f"  chained after {submitted.after.root}: {_chain_words(verdict.action, verdict.reason)}")
    typer.echo(f"  follow it: hpclaunch status {quote(paths.root)} --watch")
    if wait:
        code = _wait(paths)
        raise typer.Exit(code)


def _chain_words(action: str, reason: str) -> str:
    if action == "release":
        return f"{reason}, so this run was released"
    if action == "cancel":
        return f"{reason}, so this run was cancelled"
    return "held until it finishes (cancelled if it fails or is cancelled)"


def _wait(paths: RunPaths, poll_s: float = 2.0) -> int:
    """``submit --wait`` and ``status --watch``: until the run (every sweep point) has ended, shown
    live in a terminal; then its status and, unless it finished, one line saying how it ended. The
    exit code is ``ended_code``'s. Ctrl-C ends the waiting, not the run (130)."""
    roots = sweep_roots(paths) or [paths.root]
    try:
        views = _wait_until_ended(roots, poll_s)
    except KeyboardInterrupt:
        err_console.print(
            f"hpclaunch: stopped waiting; the run goes on. Follow it: hpclaunch status {quote(paths.root)} "
            f"--watch; stop it with a checkpoint: hpclaunch stop {quote(paths.root)}; end it now: "
            f"hpclaunch cancel {quote(paths.root)}",
            highlight=False,
        )
        return 130
    if len(views) > 1:
        _print_sweep(views)
    else:
        _print_status(views[0])
    for view in views:
        if view.state != "finished":
            console.print(ended_line(view), highlight=False, markup=False, soft_wrap=True)
    return ended_code(views)


def _wait_until_ended(roots: list[Path], poll_s: float) -> list[StatusView]:
    """The runs' status once none is busy; redrawn in place meanwhile when stdout is a terminal."""
    from contextlib import nullcontext

    from rich.live import Live

    def view() -> tuple[list[StatusView], Any]:
        views = [status_view(RunPaths(r)) for r in roots]
        return views, (_sweep_table(views) if len(roots) > 1 else _status_table(views[0]))

    views, shown = view()
    live = Live(shown, console=console, auto_refresh=False, transient=True) if console.is_terminal else None
    with live if live is not None else nullcontext():
        while _busy(views):
            time.sleep(poll_s)
            views, shown = view()
            if live is not None:
                live.update(shown, refresh=True)
    return views


def train(
    config: ConfigOptArg = None,
    overrides: SetOpt = None,
    script: ScriptOpt = None,
    resume: Annotated[
        bool,
        typer.Option(
            "--resume", help="Continue the run in its existing directory (CONFIG may be that directory)."
        ),
    ] = False,
) -> None:
    """Train in the foreground on this machine: the node agent and its rank host (no scheduler).

    Ctrl-C, or 'hpclaunch stop RUN' from another shell, stops all ranks at the same step and saves.
    Run the same command with --resume to continue.

    Exit codes: 0 finished, 1 failed, 2 bad input (nothing written),
    3 ended by the user (hpclaunch stop, Ctrl-C, hpclaunch cancel), 4 stopped at the time limit, 5 preempted
    (3, 4 and 5 are resumable with --resume).

    Examples:
      hpclaunch train examples/tiny.yaml --set train.steps=50
      hpclaunch train runs/tiny --resume --set train.steps=100
      hpclaunch train --script train.py --set scheduler.procs_per_node=2 -- --steps 200
    """
    import os

    from ..orchestrator.launch import refuse_moving_a_resume
    from ..orchestrator.login_flow import foreground_run, plan_train, schedule_pin
    from ..rundir.env import FOREGROUND_VAR
    from .live_progress import live_progress

    config = list(config or [])
    own = resume and len(config) == 1 and not config[0].is_file()
    here = [("scheduler.kind=local", "hpclaunch train")]  # this machine, always
    if own:
        # RUN, not a CONFIG file: named like every other command that takes a run (what is there)
        run = RunPaths(found(config[0]).path)
        refuse_moving_a_resume(run.root, overrides or [])
        config = [run.config]  # the config it was started with, continued where RUN is now
        here.append((f"run_dir={json.dumps(str(run.root.resolve()))}", "RUN"))
    cfg = load_run_config(config, overrides, script, here, command="train", run_written=own)
    if resume and (pin := schedule_pin(cfg, overrides or [])) is not None:  # as for submit --resume
        cfg = load_run_config(
            config, [*(overrides or []), pin], script, here, command="train", run_written=own
        )
    planned = plan_train(cfg, resume=resume)
    paths, change = planned.paths, planned.change
    with foreground_run(planned):
        if change is not None:
            err_console.print(change.line(), highlight=False, soft_wrap=True)
        os.environ[FOREGROUND_VAR] = "1"
        with live_progress(paths.metrics, None if cfg.is_script else cfg.train.steps):
            code = _attempts_in_the_foreground(str(paths.root))
    from .train_end import last_word

    raise typer.Exit(last_word(paths, config, overrides, code))


def _attempts_in_the_foreground(run_dir: str) -> int:
    """What the local controller does for a submitted job: another attempt (restart count + 1)
    for as long as the agent's decision is to continue (a crash or a hang within its budget)."""
    import os

    from ..jobs.agent import agent_main
    from ..rundir.env import RESTART_VAR
    from ..schedulers.protocol import LOCAL_REQUEUE_EXIT

    restart = 0
    while True:
        os.environ[RESTART_VAR] = str(restart)
        code = agent_main(run_dir)
        if code != LOCAL_REQUEUE_EXIT:
            return code
        restart += 1
        err_console.print(f"hpclaunch: continuing in the foreground (attempt {restart + 1})", highlight=False)


def _first_line(text: str, width: int = 90) -> str:
    """An error as one short line (the whole text stays in ``status --json``)."""
    line = str(text).strip().splitlines()[0] if str(text).strip() else ""
    return line if len(line) <= width else line[: width - 1] + "…"


def status(
    run: RunArg,
    as_json: JsonOpt = False,
    watch: Annotated[
        bool,
        typer.Option("--watch", help="Refresh in place every 2 s until the run ends; exit 1 if it failed."),
    ] = False,
) -> None:
    """Attempts (how each ended and why), current step, loss, throughput, ETA and goodput.

    Examples:
      hpclaunch status runs/tiny
      hpclaunch status runs/tiny --json | jq .goodput
    """
    paths = run_paths(run)
    points = sweep_roots(paths)
    if watch and not as_json:
        raise typer.Exit(_wait(paths))
    if points:
        rows = [status_view(RunPaths(p)) for p in points]
        if as_json:
            print_json({"sweep": str(paths.root), "points": [r.to_json() for r in rows]})
        else:
            _print_sweep(rows)
        return
    data = status_view(paths)
    if as_json:
        print_json(data.to_json())
    else:
        _print_status(data)


def _print_status(data: StatusView) -> None:
    console.print(_status_table(data))


def _fmt_time(ts: float | None) -> str:
    return time.strftime("%H:%M:%S", time.localtime(ts)) if ts else "-"


def _status_table(data: StatusView) -> Any:
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    from .time_view import time_parts

    sched, rescue = data.scheduler, data.rescue
    head = Text.assemble(
        (f"{data.run}", "bold"),
        f"  state: {data.state}",
        f"  job: {data.job_id or '-'}",
        f" ({sched.raw or sched.state or 'n/a'})" if sched else "",
        f"  rescue: job {rescue.job_id}" if rescue.job_id else "",
    )
    loss = data.loss
    progress = Text(
        f"step {data.step}/{data.steps or '?'}"
        + (f"  loss {loss:.4f}" if isinstance(loss, (int, float)) else "")
        + "".join(f"  {name} {value:.4g}" for name, value in data.logged.items())
        + (f"  {data.samples_per_s:.1f} samples/s" if data.samples_per_s else "")
        + (
            f"  {data.tflops_per_gpu:.0f} TFLOP/s per GPU (MFU {data.mfu:.1%})"
            if data.mfu and data.tflops_per_gpu
            else ""
        )
    )
    table = Table(title="attempts", title_justify="left")
    for col in ("#", "job", "nodes", "started", "steps", "ckpt", "end", "cause"):
        table.add_column(col)
    for i, a in enumerate(data.attempts, 1):
        steps = steps_text(a)
        end = a.end + (f": {_first_line(a.error)}" if a.error else "")
        if a.replaced:
            end += " (" + ", ".join(f"{s} for {n}" for n, s in a.replaced.items()) + ")"
        table.add_row(
            str(i),
            str(a.job_id or "-"),
            str(a.nodes or "-"),
            _fmt_time(a.started),
            steps,
            str(a.checkpoint_step or "-") + (f" ({a.failed_saves} failed)" if a.failed_saves else ""),
            Text(end),  # error texts hold brackets ("[/path/pair.cc:537]"): never markup
            Text(a.cause or ""),
        )
    parts: list[Any] = [head, progress, *lineage_parts(data)]
    parts += [Text(line, style="cyan") for line in data.schedule_changes]  # what each resume changed
    parts += [table, *time_parts(data)]
    parts += [Text(note) for note in rescue.notes]
    if interval := describe_interval(data.checkpoint_interval):
        parts.append(Text(interval))
    if advice := interval_advice(data.checkpoint_interval):
        parts.append(Text(advice, style="yellow"))
    for i, line in enumerate(describe_memory_tier(data.memory_tier)):
        parts.append(Text(line, style="yellow" if i else ""))
    if failed := describe_failed_saves(data.failed_saves):
        parts.append(Text(failed, style="yellow"))
    for line in describe_experiment_logs(data.experiment_logs):
        parts.append(Text(line, style="yellow"))
    if stragglers := describe_stragglers(data.stragglers):
        parts.append(Text(stragglers, style="yellow" if data.stragglers.reported else ""))
    if data.hint:
        parts.append(Text(f"hint: {data.hint}", style="yellow"))
    for warning in data.ledger_warnings:
        parts.append(Text(f"ledger: {warning}", style="yellow"))
    return Group(*parts)


def lineage_parts(data: StatusView) -> list[Any]:
    """Where the weights came from and the chain this run is part of (status lines)."""
    from rich.text import Text

    from ..orchestrator.cost import describe as describe_cost
    from ..orchestrator.lineage import describe_chain, describe_weights

    lines = [
        describe_cost(data.cost),
        describe_weights(data.weights_from),
        *describe_chain(data.chain),
    ]
    return [Text(line, style="cyan") for line in lines if line]


def _print_sweep(rows: list[StatusView]) -> None:
    console.print(_sweep_table(rows))


def _sweep_table(rows: list[StatusView]) -> Any:
    from rich.table import Table

    table = Table(title="sweep", title_justify="left")
    # A point's name is what tells the points apart: never cut short (on a narrow or piped
    # console it wraps instead), whatever else has to give.
    table.add_column("point", overflow="fold", min_width=12)
    for col in ("state", "job", "step", "loss", "attempts", "goodput"):
        table.add_column(col)
    for r in rows:
        loss = r.loss
        ratio = r.time.goodput
        table.add_row(
            r.run_name,
            r.state,
            str(r.job_id or "-"),
            f"{r.step}/{r.steps or '?'}",
            f"{loss:.4f}" if isinstance(loss, (int, float)) else "-",
            str(len(r.attempts)),
            f"{ratio:.1%}" if ratio is not None else "-",
        )
    return table
