"""Helpers for tests that run whole hpclaunch runs through the real CLI (subprocesses)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "tiny.yaml"


def hpclaunch(
    *args: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = 600, check: bool = True
) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, **(env or {})}
    full_env.pop("HPCLAUNCH_DEBUG", None)
    result = subprocess.run(
        [sys.executable, "-m", "hpclaunch", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
    )
    if check and result.returncode != 0:
        raise AssertionError(
            f"hpclaunch {' '.join(args)} exited {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        )
    return result


def synth_data(directory: Path, samples: int = 512) -> Path:
    if not (directory / "tokens").exists():
        hpclaunch(
            "data", "synth", str(directory), "--samples", str(samples), "--seed", "0", cwd=directory.parent
        )
    return directory


def outlasting(
    steps: int, step_sleep_s: float, *, time_limit_s: float, stop_margin_s: float
) -> tuple[str, ...]:
    """The overrides of a run that its time limit must stop on any machine, however fast: its slept
    steps alone last longer than the limit less the stop margin, with a tenth to spare (start-up and
    the steps' own compute only add to them). Checked where a test sets its sizes, at import.

    The attempts that resume run at full speed (``testing.step_sleep_resumed=false``): the first
    one is stopped by its limit, and the rest of the run ends in the next, not in as many one-minute
    attempts as a loaded machine's start-ups leave room for (CI saw 15 for 80 steps)."""
    slept = steps * step_sleep_s
    if slept <= 1.1 * (time_limit_s - stop_margin_s):
        raise ValueError(
            f"{steps} steps x {step_sleep_s} s = {slept:.0f} s of sleep would fit a {time_limit_s:.0f} s limit "
            f"less its {stop_margin_s:.0f} s margin on a fast machine: raise the steps or the sleep"
        )
    return (
        f"train.steps={steps}",
        f"testing.step_sleep_s={step_sleep_s}",
        f"launch.stop_margin_s={stop_margin_s:g}",
        "testing.step_sleep_resumed=false",
    )


def sets(*overrides: str) -> list[str]:
    out: list[str] = []
    for item in overrides:
        out += ["--set", item]
    return out


def tiny_overrides(work: Path, data: Path, name: str, *extra: str) -> list[str]:
    return sets(
        f"name={name}",
        f"run_dir={work / 'runs' / name}",
        f"data.token_dir={data / 'tokens'}",
        f"data.latent_dir={data / 'latents'}",
        *extra,
    )


def status(run: Path, cwd: Path) -> dict[str, Any]:
    return json.loads(hpclaunch("status", str(run), "--json", cwd=cwd).stdout)


def events(run: Path) -> list[dict[str, Any]]:
    """The run's merged ledger (every writer's file under RUN/events/), as the lines on disk."""
    from hpclaunch.rundir import RunPaths, read_events

    return [e.record for e in read_events(RunPaths(run)).events]


def attempt_ids(run: Path) -> list[str]:
    """The run's attempts in the order they started, by its ledger."""
    return list(dict.fromkeys(e["attempt"] for e in events(run) if e["event"] == "started"))


def last_logged_step(run: Path) -> int:
    """The newest step in ``RUN/metrics.jsonl`` (0 before the first)."""
    path = run / "metrics.jsonl"
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []
    return int(lines[-1]["step"]) if lines else 0


def wait_for(predicate: Any, *, timeout: float, poll: float = 0.5, what: str = "condition") -> Any:
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")


def wait_for_text(path: Path, text: str, timeout: float) -> str:
    """The file's content once ``text`` is in it (polled every 0.1 s), else TimeoutError with what it holds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and text in (content := path.read_text()):
            return content
        time.sleep(0.1)
    raise TimeoutError(
        f"{text!r} not in {path} after {timeout}s: {path.read_text() if path.exists() else '(no file)'}"
    )


ACTIVE = ("pending", "running", "requeued", "stopping", "finishing", "failing", "cancelling")
# How often a test waiting for a run's end asks the CLI while the ledger says the run is in flight:
# only a run the scheduler lost without its ledger saying so needs it (rare, and a test then fails
# anyway); a CLI call every 10 s was still ~5 % of the suite's running-process samples.
CONFIRM_EVERY_S = 30.0


def in_flight_by_ledger(run: Path) -> bool:
    """The run is in flight by its ledger alone, read in this process. ``hpclaunch status`` costs an
    interpreter's start (~0.5 core-s) and a scheduler query each time: polled every 2 s by both
    workers, it was about an eighth of the suite's CPU. A run the scheduler ended without its ledger saying
    so stays in flight here, so ``wait_ended`` asks the CLI every ``CONFIRM_EVERY_S`` as well."""
    from hpclaunch.orchestrator.status import attempts_from_events, run_state
    from hpclaunch.rundir import RunPaths, read_events

    try:
        events = read_events(RunPaths(run)).events
        return run_state(attempts_from_events(events), events, None) in ACTIVE
    except Exception:  # (whatever it is, the CLI says)
        return False


def wait_ended(
    status_now: Any, run: Path, *, timeout: float, poll: float, active: tuple[str, ...] = ACTIVE
) -> dict[str, Any]:
    """``status_now()`` (the CLI's ``status --json``) once neither the ledger nor the scheduler has
    the run in flight; the CLI is asked when the ledger says the run ended, and every
    ``CONFIRM_EVERY_S`` besides (the first time, that long after the wait began)."""
    asked = [time.monotonic()]

    def done() -> dict[str, Any] | None:
        if in_flight_by_ledger(run) and time.monotonic() - asked[0] < CONFIRM_EVERY_S:
            return None
        asked[0] = time.monotonic()
        s: dict[str, Any] = status_now()
        sched = (s.get("scheduler") or {}).get("state")
        return s if s["state"] not in active and sched not in active else None

    result: dict[str, Any] = wait_for(done, timeout=timeout, poll=poll, what=f"run {run.name} to end")
    return result


def wait_run_done(run: Path, cwd: Path, timeout: float) -> dict[str, Any]:
    return wait_ended(lambda: status(run, cwd), run, timeout=timeout, poll=2.0)


def final_params_sha(run: Path) -> str:
    """The parameter hash the trainer wrote in the outcome of the attempt that finished."""
    for path in sorted((run / "attempts").glob("*.json"), key=lambda p: p.stat().st_mtime, reverse=True):
        data = json.loads(path.read_text())
        if data.get("status") == "finished":
            return str(data["params_sha256"])
    raise AssertionError(f"no finished attempt in {run}")


def rank_process(run: Path, rank: int, *, timeout: float = 180) -> Any:
    """The running rank ``rank`` of the run's current attempt (a psutil.Process): the pid its
    progress heartbeat names. Ranks are forked from the rank host's forkserver, so neither their
    command line nor their /proc environment says which run or rank they are."""
    import psutil

    def found() -> Any:
        started = [e["attempt"] for e in events(run) if e["event"] == "started"]
        if not started:
            return None
        from hpclaunch.rundir import RunPaths
        from hpclaunch.rundir.progress_files import read_progress

        record = read_progress(RunPaths(run), started[-1]).get(rank)  # (its node's file, or its own)
        try:
            proc = psutil.Process(int(record.pid)) if record is not None and record.pid else None
        except psutil.Error:
            return None
        if proc is None:
            return None
        return proc if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE else None

    return wait_for(found, timeout=timeout, poll=0.1, what=f"rank {rank} of {run.name}")


def rank_on_node(run: Path, node: str, *, timeout: float = 120) -> Any:
    """A running rank of the run's current attempt on ``node`` (a psutil.Process: the pid its
    progress heartbeat names)."""
    import psutil

    def found() -> Any:
        from hpclaunch.rundir import RunPaths
        from hpclaunch.rundir.progress_files import read_progress

        attempts = attempt_ids(run)
        for _, record in sorted(read_progress(RunPaths(run), attempts[-1]).items() if attempts else []):
            if record.node == node and record.pid:
                try:  # (a heartbeat can outlive its rank for a moment: look again)
                    return psutil.Process(record.pid)
                except psutil.Error:
                    return None
        return None

    return wait_for(found, timeout=timeout, poll=0.2, what=f"a rank of {run.name} on {node}")


def training_node(run: Path) -> str:
    """The first training node of the run's newest attempt, as its decider named the roster."""
    started = [e for e in events(run) if e["event"] == "started" and e.get("node") == 0]
    return str(started[-1]["roster"]["training"][0])


def kill_together(found: list[tuple[int, str]]) -> list[str]:
    """SIGKILL every process of ``found`` (pid, command line) as one event, as a node's death is:
    all are stopped (SIGSTOP) before any is killed, so none sees another die and reacts meanwhile
    (a scheduler's daemon ending the job, mpiexec ending its launch) before the loop reaches it.
    Children die before their parents and the job's shell last: its death is what ends the job,
    and the scheduler then sends SIGCONT and SIGTERM to what is left (srun, woken that way, kills
    the job step everywhere at once). The command lines of those it killed (one already gone is
    left out)."""
    import signal

    stopped = []
    for pid, cmd in found:
        try:
            os.kill(pid, signal.SIGSTOP)
        except ProcessLookupError:
            continue
        stopped.append((pid, cmd))
    for pid, _ in _children_first(stopped):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return [cmd for _, cmd in stopped]


def _children_first(procs: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """``procs`` ordered deepest first (a child before its parent), the shells whose parent is not
    among them (a job's script) last."""
    import psutil

    parent: dict[int, int] = {}
    for pid, _ in procs:
        with contextlib.suppress(psutil.Error):
            parent[pid] = psutil.Process(pid).ppid()

    def depth(pid: int) -> int:
        d = 0
        while parent.get(pid) in parent and d < len(parent):
            pid, d = parent[pid], d + 1
        return d

    def job_shell(pid: int, cmd: str) -> bool:
        program = Path(cmd.split(" ")[0]).name.lstrip("-")
        return depth(pid) == 0 and program in ("bash", "sh", "dash", "zsh", "ksh", "csh", "tcsh")

    return sorted(procs, key=lambda p: (job_shell(*p), -depth(p[0])))


def process_running(pid: int) -> bool:
    """``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    import psutil

    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False


def start_script(path: Path, text: str, *args: str) -> subprocess.Popen[str]:
    """Write ``text`` to ``path`` and run it with this Python, stdin and stdout piped: a process of
    its own for what must not run in pytest's (which has threads)."""
    path.write_text(text)
    return subprocess.Popen(
        [sys.executable, str(path), *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )


def checkpoint_writers(directory: Path) -> list[int]:
    """Writer processes alive for this checkpoint directory: named ``hpcl-ckpt-write``, and holding
    the directory open (a forked writer's command line is its rank's)."""
    target = str(directory.resolve())
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if (proc / "comm").read_text().strip() != "hpcl-ckpt-write":
                continue
            links = [os.readlink(fd) for fd in (proc / "fd").iterdir()]
        except OSError:
            continue
        if target in links:
            found.append(int(proc.name))
    return found
