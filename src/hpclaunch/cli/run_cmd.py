"""``hpclaunch submit | train | status | stop | cancel | logs``: a run's life cycle."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Any

import typer

from ..errors import PreflightFailed, RunNotFoundError, RunStateError, SchedulerError, UserInputError
from ..orchestrator.checkpoint_interval import describe as describe_interval
from ..orchestrator.launch import load_existing_run, prepare, refuse_if_locked, write_run_dir
from ..orchestrator.launch import submit as submit_run
from ..orchestrator.status import StatusView, describe_experiment_logs, describe_failed_saves, steps_text
from ..orchestrator.stragglers import describe as describe_stragglers
from ..rundir import CANCELLED, STOP_REQUESTED, SUBMITTED, Ledger, RunPaths, read_events, read_plan
from ..rundir.cause import Cause
from ..rundir.outcome import AttemptOutcome
from ..rundir.readers import sweep_roots
from ..schedulers.base import ACTIVE_STATES
from .common import (
    CONFIG_HELP,
    ConfigArg,
    JsonOpt,
    SetOpt,
    config_names,
    console,
    err_console,
    load,
    print_json,
)
from .follow import attempt_log_dirs, copy_out, follow_logs

RunArg = Annotated[Path, typer.Argument(help="The run directory (runs/<name>).", metavar="RUN")]


def register(app: typer.Typer) -> None:
    app.command("submit")(submit)
    app.command("train")(train)
    app.command("status")(status)
    app.command("stop")(stop)
    app.command("cancel")(cancel)
    app.command("logs")(logs)


def _run_paths(run: Path) -> RunPaths:
    paths = RunPaths(run.resolve())
    if not paths.is_run():
        raise RunNotFoundError(
            f"{run} is not a hpclaunch run directory", where="RUN", hint="see runs/ for your runs"
        )
    return paths


def _preflight_or_refuse(cfg: Any) -> None:
    from ..preflight import run_login_checks

    report = run_login_checks(cfg)
    if report.failed:
        from ..preflight.report import print_report

        print_report(report, console=err_console)
        first = next(c for c in report.checks if c.status == "fail")
        raise PreflightFailed(
            f"preflight check '{first.name}' failed: {first.finding}; nothing was submitted",
            where="submit",
            hint=first.hint or "fix it, or submit with --no-preflight to skip the checks",
        )


def submit(
    config: Annotated[list[Path] | None, typer.Argument(help=CONFIG_HELP, metavar="CONFIG")] = None,
    overrides: SetOpt = None,
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

    Examples:
      hpclaunch submit examples/tiny.yaml --wait
      hpclaunch submit base.yaml exp-highres.yaml --set train.lr=1e-4
      hpclaunch submit run.yaml --sweep train.lr=1e-4,3e-4 --sweep model.depth=2,4
      hpclaunch submit --resume runs/tiny
      hpclaunch submit stage2.yaml --after runs/stage1
    """
    if resume is not None and config:
        raise UserInputError(
            f"--resume continues {resume} with the config it was started with; "
            f"{', '.join(map(str, config))} would be ignored",
            where="submit",
            hint=f"drop the CONFIG and change settings with --set (hpclaunch submit --resume {resume} "
            "--set train.steps=N), or submit the CONFIG as a new run without --resume",
        )
    if resume is not None:
        cfg = load_existing_run(_run_paths(resume).root, overrides or [])
        _refuse_resuming_a_finished_run(_run_paths(resume), cfg.train.steps)
    elif config:
        cfg = load(config, overrides)
    else:
        raise UserInputError(
            "give a CONFIG file or --resume RUN", where="submit", hint="hpclaunch submit examples/tiny.yaml"
        )
    prepared = prepare(cfg, sweeps=sweep or [])
    for warning in prepared.rendered.warnings:
        err_console.print(f"[yellow]warning:[/] {warning}", highlight=False)
    after_paths = None
    if after is not None:
        from ..orchestrator.chain import check_after

        after_paths = check_after(after, prepared.plan.paths().root, sweep=bool(sweep))
    if resume is not None:
        refuse_if_locked(prepared.plan)
        from .train_checks import refuse_other_model_shape

        refuse_other_model_shape(cfg, prepared.plan.paths().root)
    from .train_checks import refuse_bad_init_from

    # Chained after the run it starts from: that run may have no checkpoint yet.
    pending = after_paths is not None and Path(cfg.train.init_from or "").resolve() == after_paths.root
    refuse_bad_init_from(cfg, prepared.plan.paths().root, pending_ok=pending)
    if not no_preflight:
        _preflight_or_refuse(cfg)
    paths, job_id = submit_run(
        prepared, run_preflight=not no_preflight, resume=resume is not None, held=after_paths is not None
    )
    typer.echo(f"submitted {cfg.name} as {prepared.plan.scheduler} job {job_id}; run directory {paths.root}")
    if after_paths is not None:
        from ..orchestrator.chain import register_and_settle

        verdict = register_and_settle(after_paths, paths, prepared.plan.scheduler, job_id)
        typer.echo(f"  chained after {after_paths.root}: {_chain_words(verdict.action, verdict.reason)}")
    typer.echo(f"  follow it: hpclaunch status {paths.root} --watch")
    if wait:
        code = _wait(paths)
        raise typer.Exit(code)


def _refuse_resuming_a_finished_run(paths: RunPaths, steps: int) -> None:
    """A finished run has nothing to train: a job would start, load its last checkpoint and end."""
    view = _status_view(paths)
    if view.state == "finished" and int(view.step or 0) >= steps:
        raise RunStateError(
            f"{paths.root} has finished (step {view.step}/{steps}): there is nothing to resume",
            where="--resume",
            hint=f"to train it longer: hpclaunch submit --resume {paths.root} --set train.steps=N "
            f"(N > {view.step})",
        )


def _chain_words(action: str, reason: str) -> str:
    if action == "release":
        return f"{reason}, so this run was released"
    if action == "cancel":
        return f"{reason}, so this run was cancelled"
    return "held until it finishes (cancelled if it fails or is cancelled)"


def _plan_scheduler(paths: RunPaths) -> str | None:
    try:
        return read_plan(paths).scheduler
    except (FileNotFoundError, ValueError):
        return None


def _wait(paths: RunPaths, poll_s: float = 2.0) -> int:
    """Until the run is no longer pending/running/requeued; exit code 0 only for 'finished'. In a
    terminal the status is shown live meanwhile. Ctrl-C ends the waiting, not the run (130)."""
    roots = _sweep_points(paths) or [paths.root]
    try:
        views = _wait_until_ended(roots, poll_s)
    except KeyboardInterrupt:
        err_console.print(
            f"hpclaunch: stopped waiting; the run goes on. Follow it: hpclaunch status {paths.root} "
            f"--watch; stop it with a checkpoint: hpclaunch stop {paths.root}; end it now: "
            f"hpclaunch cancel {paths.root}",
            highlight=False,
        )
        return 130
    if len(views) > 1:
        _print_sweep(views)
    else:
        _print_status(views[0])
    return 0 if all(v.state == "finished" for v in views) else 1


def _wait_until_ended(roots: list[Path], poll_s: float) -> list[StatusView]:
    """The runs' status once none is busy; redrawn in place meanwhile when stdout is a terminal."""
    from contextlib import nullcontext

    from rich.live import Live

    def view() -> tuple[list[StatusView], Any]:
        views = [_status_view(RunPaths(r)) for r in roots]
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


def _busy(views: list[StatusView]) -> bool:
    """Some run is mid-flight by our ledger OR its scheduler still holds an active job (between a
    trainer's stop and the agent's requeue decision the ledger alone says "stopped")."""
    return any(
        v.state in ACTIVE_STATES or (v.scheduler is not None and v.scheduler.state in ACTIVE_STATES)
        for v in views
    )


def _ended_code(views: list[StatusView]) -> int:
    """Once the run has ended: 1 when it (or a sweep point) failed or was lost, else 0."""
    return 1 if any(v.state == "failed" or v.state.startswith("lost") for v in views) else 0


def _sweep_points(paths: RunPaths) -> list[Path]:
    return sweep_roots(paths)


def _scheduler_status(paths: RunPaths) -> Any:
    from ..orchestrator.status import current_job_id
    from ..schedulers.registry import get_scheduler

    job_id = current_job_id(read_events(paths).events)
    kind = _plan_scheduler(paths)
    if not job_id or not kind:
        return None
    try:
        return get_scheduler(kind).status(paths, job_id)
    except SchedulerError:
        return None


def _status_view(paths: RunPaths) -> StatusView:
    from ..orchestrator.status import summarize

    return summarize(paths.root, scheduler_status=_scheduler_status(paths))


def train(
    config: ConfigArg,
    overrides: SetOpt = None,
    resume: Annotated[
        bool, typer.Option("--resume", help="Continue the run in its existing directory.")
    ] = False,
) -> None:
    """Train in the foreground on this machine: the node agent and its rank host (no scheduler).

    Ctrl-C stops all ranks at the same step and saves; run the same command with --resume to continue.

    Example: hpclaunch train examples/tiny.yaml --set train.steps=50
    """
    import os

    from ..config import validate_config
    from ..jobs.agent import FOREGROUND_VAR
    from ..orchestrator.launch import scheduler_says_active
    from ..rundir import STOP_DROPPED, Heartbeat, RunLock, latest_outcome
    from ..rundir.control import drop_user_stop
    from .live_progress import live_progress
    from .train_checks import refuse_bad_data, refuse_bad_init_from, refuse_other_model_shape

    cfg = load(config, overrides)
    raw = cfg.to_dict()
    raw["scheduler"] = {**raw["scheduler"], "kind": "local"}
    cfg = validate_config(raw, where=config_names(config))
    prepared = prepare(cfg)
    paths = prepared.plan.paths()
    if paths.is_run() and not resume:
        raise UserInputError(
            f"a run already exists in {paths.root}",
            where="run_dir",
            hint="add --resume to continue it, or change name/run_dir",
        )
    refuse_bad_data(cfg)
    if resume:
        refuse_other_model_shape(cfg, paths.root)
    refuse_bad_init_from(cfg, paths.root)
    job_id = f"fg{os.getpid()}"  # the job id the in-process agent sees (no HPCLAUNCH_JOB_ID)
    lock = RunLock(paths)
    holder = lock.acquire(
        job_id=job_id, scheduler="local", role="train", is_active=scheduler_says_active(paths)
    )
    try:
        # The heartbeat tells another host sharing the filesystem that this run is alive.
        with Heartbeat(lock, holder):
            write_run_dir(cfg, prepared.plan, prepared.rendered)
            ledger = Ledger(paths, role="cli")
            dropped = drop_user_stop(paths) if resume else None
            if dropped is not None:
                ledger.append(STOP_DROPPED, by=dropped.by, requested_at=dropped.requested_at)
            ledger.append(SUBMITTED, job_id=job_id, scheduler="foreground", resume=resume)
            os.environ[FOREGROUND_VAR] = "1"
            with live_progress(paths.metrics, cfg.train.steps):
                code = _attempts_in_the_foreground(str(paths.root))
    finally:
        lock.release(holder)
    outcome = latest_outcome(paths)
    if outcome is not None and outcome.status == "failed":
        # The reason is the last line; the rank host's own report stays in the node log.
        console.print(
            f"failed at step {outcome.step} ({outcome.cause}); the ranks' full report is in {paths.logs}/",
            highlight=False,
        )
        err_console.print(f"hpclaunch: training failed: {outcome.error}", highlight=False, markup=False)
    elif outcome is not None and outcome.status != "stopped":
        console.print(f"{outcome.status} at step {outcome.step}", highlight=False)  # the last word
    elif outcome is not None:
        # What continues a foreground run is this command, not `submit --resume`.
        again = " ".join(str(c) for c in config) + "".join(f" --set {o}" for o in overrides or [])
        console.print(
            f"stopped at step {outcome.step} ({outcome.cause}); continue it: hpclaunch train {again} --resume",
            highlight=False,
            soft_wrap=True,  # a command to copy: never broken across lines
        )
    raise typer.Exit(_train_exit_code(outcome, code))


def _attempts_in_the_foreground(run_dir: str) -> int:
    """What the local controller does for a submitted job: another attempt (restart count + 1)
    for as long as the agent's decision is to continue (a crash or a hang within its budget)."""
    import os

    from ..jobs.agent import agent_main
    from ..rundir.env import RESTART_VAR
    from ..schedulers.base import LOCAL_REQUEUE_EXIT

    restart = 0
    while True:
        os.environ[RESTART_VAR] = str(restart)
        code = agent_main(run_dir)
        if code != LOCAL_REQUEUE_EXIT:
            return code
        restart += 1
        err_console.print(f"hpclaunch: continuing in the foreground (attempt {restart + 1})", highlight=False)


# Foreground exit codes name the cause: 0 finished, 1 failed, 3 user stop, 4 timeout, 5 preemption.
_STOP_EXIT = {Cause.USER: 3, Cause.TIMEOUT: 4, Cause.PREEMPTION: 5}


def _first_line(text: str, width: int = 90) -> str:
    """An error as one short line (the whole text stays in ``status --json``)."""
    line = str(text).strip().splitlines()[0] if str(text).strip() else ""
    return line if len(line) <= width else line[: width - 1] + "…"


def _train_exit_code(outcome: AttemptOutcome | None, agent_code: int) -> int:
    if outcome is None:
        return agent_code or 1
    if outcome.status == "finished":
        return 0
    if outcome.status == "stopped":
        return _STOP_EXIT.get(outcome.cause or Cause.USER, 3)
    return 1


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
    paths = _run_paths(run)
    points = _sweep_points(paths)
    if watch and not as_json:
        raise typer.Exit(_watch(paths, points))
    if points:
        rows = [_status_view(RunPaths(p)) for p in points]
        if as_json:
            print_json({"sweep": str(paths.root), "points": [r.to_json() for r in rows]})
        else:
            _print_sweep(rows)
        return
    data = _status_view(paths)
    if as_json:
        print_json(data.to_json())
    else:
        _print_status(data)


def _watch(paths: RunPaths, points: list[Path], poll_s: float = 2.0) -> int:
    """Redraw the status in place until the run (every sweep point) has ended; its exit code."""
    from rich.live import Live

    def view() -> tuple[list[StatusView], Any]:
        if points:
            rows = [_status_view(RunPaths(p)) for p in points]
            return rows, _sweep_table(rows)
        data = _status_view(paths)
        return [data], _status_table(data)

    views, shown = view()
    with Live(shown, console=console, auto_refresh=False) as live:
        while _busy(views):
            time.sleep(poll_s)
            views, shown = view()
            live.update(shown, refresh=True)
    return _ended_code(views)


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
    parts: list[Any] = [head, progress, *lineage_parts(data), table, *time_parts(data)]
    parts += [Text(note) for note in rescue.notes]
    if interval := describe_interval(data.checkpoint_interval):
        parts.append(Text(interval))
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


def stop(
    run: RunArg,
    continue_: Annotated[
        bool,
        typer.Option(
            "--continue", help="After the save, continue automatically (requeue) instead of ending."
        ),
    ] = False,
) -> None:
    """Stop a running run gracefully: every rank stops at the same step and saves a checkpoint.

    Continue later with 'hpclaunch submit --resume RUN' (or at once with --continue).

    Example: hpclaunch stop runs/tiny
    """
    from ..orchestrator.status import running_attempt
    from ..rundir.control import write_user_stop

    paths = _run_paths(run)
    # A sweep's root runs nothing itself: the request goes to every point that still runs.
    points = sweep_roots(paths)
    views = {p: _status_view(p) for p in [RunPaths(p) for p in points] or [paths]}
    targets = [p for p, view in views.items() if _busy([view])]
    if not targets:
        states = sorted({view.state for view in views.values()})
        raise RunStateError(
            f"nothing to stop: {'every point of the sweep' if points else 'the run'} has ended "
            f"({', '.join(states)}); nothing was written",
            where=str(paths.root),
            hint=f"see hpclaunch status {paths.root}; continue a stopped run with hpclaunch submit --resume",
        )
    for target in targets:
        attempt = running_attempt(read_events(target).events)
        write_user_stop(target, continue_=continue_, attempt=attempt, by="hpclaunch stop")
        Ledger(target, role="cli").append(
            STOP_REQUESTED,
            cause=Cause.USER,
            source="hpclaunch stop",
            continue_=continue_,
            attempt_seen=attempt,
        )
    what = f"{len(targets)} of the {len(points)} points of sweep {paths.root}" if points else str(paths.root)
    console.print(f"stop requested for {what}: all ranks will save at the next check", highlight=False)


def cancel(run: RunArg) -> None:
    """Cancel the run's job at once (scancel / qdel / local kill); no checkpoint is guaranteed.

    Example: hpclaunch cancel runs/tiny
    """
    from ..orchestrator.status import current_job_id
    from ..schedulers.registry import get_scheduler

    paths = _run_paths(run)
    job_id = current_job_id(read_events(paths).events)
    kind = _plan_scheduler(paths)
    if not job_id or not kind:
        raise UserInputError("this run has no submitted job", where=str(paths.root))
    # Recorded first: the agent reads it to tell this cancellation from a preemption.
    Ledger(paths, role="cli").append(CANCELLED, job_id=job_id, by="hpclaunch cancel")
    from ..schedulers.rescue import withdraw_rescues

    # Its rescue first: a cancelled job ends "not ok", which would start it (to do nothing).
    withdraw_rescues(paths, get_scheduler(kind), role="cli")
    get_scheduler(kind).cancel(paths, job_id)
    console.print(f"cancelled job {job_id}", highlight=False)
    from ..schedulers.chain import settle_followers

    for follower, _ in settle_followers(paths, by="hpclaunch cancel"):
        console.print(f"cancelled {follower.run} (chained after this run)", highlight=False)


def logs(
    run: RunArg,
    follow: Annotated[
        bool,
        typer.Option(
            "-f",
            "--follow",
            help="Keep printing as the log grows, move on to the next attempt when the run is requeued, "
            "stop when the run ends (exit 1 if it failed).",
        ),
    ] = False,
    attempt: Annotated[
        int | None, typer.Option("--attempt", help="Attempt number (1 = first; default latest).")
    ] = None,
    node: Annotated[int, typer.Option("--node", help="Node rank.")] = 0,
) -> None:
    """Print one node's log of one attempt (the node agent, its rank host and all ranks' output).

    Examples:
      hpclaunch logs runs/tiny --attempt 1
      hpclaunch logs runs/tiny -f
    """
    paths = _run_paths(run)
    points = sweep_roots(paths)
    if points:  # a sweep's root runs nothing itself: its points have the logs
        names = ", ".join(Path(p).name for p in points)
        raise UserInputError(
            f"a sweep of {len(points)} points: each point has its own logs ({names})",
            where=str(paths.root),
            hint=f"hpclaunch logs {points[0]}",
        )
    dirs = attempt_log_dirs(paths)
    if not dirs and follow:
        err_console.print("waiting for the job to start ...", highlight=False)
        while not dirs and _busy([_status_view(paths)]):
            time.sleep(1.0)
            dirs = attempt_log_dirs(paths)
    if not dirs:
        raise UserInputError("no logs yet (the job has not started)", where=str(paths.logs))
    if attempt is not None and not 1 <= attempt <= len(dirs):
        raise UserInputError(f"attempt {attempt} does not exist (1..{len(dirs)})", where="--attempt")
    index = (attempt or len(dirs)) - 1
    log = dirs[index] / f"node{node}.log"
    if not log.exists() and not follow:
        raise UserInputError(f"no log for node {node}", where=str(log))
    if not follow:
        copy_out(log)
        return

    def ended() -> int | None:
        view = _status_view(paths)
        return None if _busy([view]) else _ended_code([view])

    raise typer.Exit(follow_logs(paths, dirs, index, node, pinned=attempt is not None, ended=ended))
