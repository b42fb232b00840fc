"""What one stop and restart costs: from the stop signal to the continuation's first step.

A tiny run (2 gloo ranks) is submitted through the real CLI and stopped the way a scheduler stops
it, with nothing else running from this script (it only reads files while it waits):

  sigterm   local scheduler: SIGTERM to the job's process group, as a scheduler's preemption does;
  deadline  local scheduler: the attempt's own deadline (time limit minus save time and margin);
  slurm     the real local SLURM: ``scontrol requeue JOB`` (SLURM's own requeue hold shown apart;
            the run holds /tmp/hpclaunch-slurm.lock, the lock every user of the shared cluster takes).

The time from the stop to the end of the continuation's first step is broken down by the run's
own accounting (``status --json`` -> ``time``): steps finished after the signal, the stop save,
the trainer's exit and the agent's decision, the wait for the next allocation, start-up (job
start, node checks, rank host + imports + rendezvous + smoke test + data + model + load) and the
first step. Beside it: ``python -c "import torch"`` measured in the same run (the process start-up
this machine imposes on any restart) and a checkpoint load of the same state. Goal: the restart
costs at most one such process start-up more than save + load. Figures only, no assertions.

    .venv/bin/python bench/restart_cost.py [--scenario sigterm deadline slurm]
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "tiny.yaml"
SLURM_LOCK = Path("/tmp/hpclaunch-slurm.lock")
COMMON = (
    "train.log_every=1",
    "checkpoint.every_steps=100000",  # only the stop save: the restart is measured, not periodic saves
    "testing.step_sleep_s=0.05",
    "launch.stop_margin_s=3",
)
STEP_BEFORE_STOP = 20


def cli(*args: str, cwd: Path, check: bool = True) -> str:
    out = subprocess.run([sys.executable, "-m", "hpclaunch", *args], cwd=cwd, capture_output=True, text=True)
    if check and out.returncode != 0:
        raise SystemExit(f"hpclaunch {' '.join(args)} failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    return out.stdout


def ledger(run: Path) -> list[dict[str, Any]]:
    out = []
    for f in sorted((run / "events").glob("*.jsonl")) if (run / "events").is_dir() else []:
        for line in f.read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                out.append(json.loads(line))
    return sorted(out, key=lambda e: e.get("ts", 0))


def metrics(run: Path) -> list[dict[str, Any]]:
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            out.append(json.loads(line))
    return out


def wait(predicate: Callable[[], Any], what: str, timeout: float = 600, poll: float = 0.2) -> Any:
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise SystemExit(f"timed out waiting for {what}")


def attempts(run: Path) -> list[str]:
    return list(dict.fromkeys(e["attempt"] for e in ledger(run) if e.get("event") == "started"))


def stepped(run: Path, attempt_no: int, step: int) -> bool:
    keys = attempts(run)
    if len(keys) < attempt_no:
        return False
    return any(m.get("attempt") == keys[attempt_no - 1] and m["step"] >= step for m in metrics(run))


def ended(run: Path) -> bool:
    return any(e.get("event") in ("finished", "failed", "ended", "cancelled") for e in ledger(run))


def submit(work: Path, data: Path, name: str, *extra: str) -> Path:
    run = work / "runs" / name
    sets = [
        f"name={name}",
        f"run_dir={run}",
        f"data.token_dir={data / 'tokens'}",
        f"data.latent_dir={data / 'latents'}",
        *COMMON,
        *extra,
    ]
    cli("submit", str(TINY), "--no-preflight", *[x for s in sets for x in ("--set", s)], cwd=work)
    return run


# ---- the three ways to stop --------------------------------------------------------------------


def by_sigterm(work: Path, data: Path) -> tuple[Path, float | None, dict[str, Any]]:
    run = submit(work, data, "sigterm", "train.steps=60", "scheduler.time_limit=10m")
    wait(lambda: stepped(run, 1, STEP_BEFORE_STOP), "step 20")
    agent = next(e for e in ledger(run) if e.get("event") == "started")["pid"]
    signalled = time.time()
    os.killpg(os.getpgid(int(agent)), signal.SIGTERM)  # the job's process group, like a scheduler
    wait(lambda: ended(run), "the run's end")
    return run, signalled, {}


def by_deadline(work: Path, data: Path) -> tuple[Path, float | None, dict[str, Any]]:
    # 60 s per attempt: the start-up, then training until the deadline stops it; the continuation
    # is stopped by the user right after its first step, so the run ends there.
    run = submit(work, data, "deadline", "train.steps=100000", "scheduler.time_limit=60s")
    wait(lambda: stepped(run, 2, 1), "the continuation's first step", timeout=300)
    cli("stop", str(run), cwd=work)
    wait(lambda: ended(run), "the run's end")
    return run, None, {}


def by_slurm_requeue(work: Path, data: Path) -> tuple[Path, float | None, dict[str, Any]]:
    run = submit(work, data, "slurm", "train.steps=60", "scheduler.kind=slurm", "scheduler.time_limit=10m")
    job = wait(
        lambda: next((e["job_id"] for e in ledger(run) if e.get("event") == "submitted"), None), "job id"
    )
    wait(lambda: stepped(run, 1, STEP_BEFORE_STOP), "step 20", timeout=300)
    signalled = time.time()
    subprocess.run(["scontrol", "requeue", str(job)], check=True)
    wait(lambda: len(attempts(run)) >= 2, "the requeued job's start", timeout=600)
    info = scontrol_job(str(job))
    wait(lambda: ended(run), "the run's end")
    return run, signalled, {"slurm": info}


def scontrol_job(job: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True).stdout
    fields = dict(kv.split("=", 1) for kv in out.split() if "=" in kv)
    return {k: fields.get(k, "?") for k in ("SubmitTime", "EligibleTime", "StartTime", "Restarts")}


@contextlib.contextmanager
def slurm_lock() -> Iterator[None]:
    with open(SLURM_LOCK, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # flock(2), as flock(1) takes it
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# ---- the breakdown -------------------------------------------------------------------------------


def breakdown(run: Path, work: Path, signalled: float | None) -> dict[str, Any]:
    summary = json.loads(cli("status", str(run), "--json", cwd=work))
    first, second = summary["time"]["attempts"][:2]
    segs = {s[0]: s for s in first["segments"]}
    last_step_end = segs.get("end_save", segs.get("idle"))[1]
    signalled = signalled if signalled is not None else last_step_end
    key = second["attempt"]
    first_line = next(m for m in metrics(run) if m.get("attempt") == key)
    resumed = next(e for e in ledger(run) if e.get("event") == "resumed" and e.get("attempt") == key)
    rows = [
        ("stop signal -> the step in flight is done", last_step_end - signalled),
        ("stop save (synchronous, all ranks)", first["end_save_s"]),
        ("trainer exit + the agent's decision", first["idle_s"]),
        ("waiting for the next allocation (queue)", second["queue_s"] or 0.0),
    ]
    labels = {
        "scheduler": "start-up: job script + agent start",
        "node_checks": "start-up: node checks",
        "launch": "start-up: rank host + rendezvous + fork",
        "trainer": "start-up: launch, imports, rendezvous, smoke test, data, model, load",
    }
    for name, seconds in second["startup_parts"].items():
        rows.append((labels.get(name, f"start-up: {name}"), seconds))
    rows.append(("first step", float(first_line["ts"]) - float(resumed["ts"])))
    total = float(first_line["ts"]) - signalled
    return {"rows": rows, "total": total, "save": first["end_save_s"], "startup": second["startup_parts"]}


REPEATS = 3  # each process-start figure is a median of this many (--smoke: 1)


def import_torch_s(python: str = sys.executable, repeats: int | None = None) -> float:
    repeats = repeats or REPEATS
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        subprocess.run([python, "-c", "import torch"], check=True)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# After torch, what the trainer imports before its first step (mmdit pulls in x_transformers -> einx
# -> torch._dynamo, DCP pulls in DTensor -> sympy); then the time the process takes to exit.
_PARTS = (
    "import time; t0 = time.perf_counter(); import torch; t1 = time.perf_counter(); "
    "import mmdit, torch.distributed.checkpoint; t2 = time.perf_counter(); "
    "print(t1 - t0, t2 - t1, time.time(), flush=True)"
)


def process_parts_s(python: str = sys.executable, repeats: int | None = None) -> tuple[float, float, float]:
    """Medians of: import torch, then mmdit + DCP, inside the process; and its exit (last line -> reaped)."""
    repeats = repeats or REPEATS
    rows = []
    for _ in range(repeats):
        out = subprocess.run([python, "-c", _PARTS], check=True, capture_output=True, text=True)
        reaped = time.time()
        torch_s, more_s, printed = (float(x) for x in out.stdout.split())
        rows.append((torch_s, more_s, reaped - printed))
    return tuple(statistics.median(r[i] for r in rows) for i in range(3))  # type: ignore[return-value]


def load_s(run: Path, work: Path) -> float:
    """One checkpoint load of the run's newest checkpoint: a single process, the trainer's own path."""
    import shutil

    from hpclaunch.rundir import RunPaths, read_config
    from hpclaunch.trainer.loop import Trainer

    copy = work / "load-probe"
    shutil.copytree(run / "checkpoints", copy / "checkpoints")
    shutil.copy(run / "config.yaml", copy / "config.yaml")
    paths = RunPaths(copy).ensure()
    trainer = Trainer(read_config(paths), paths, attempt="load-probe", echo=False)
    t0 = time.perf_counter()
    trainer.resume()
    seconds = time.perf_counter() - t0
    trainer.close()
    return seconds


SCENARIOS = {
    "sigterm": ("local scheduler, SIGTERM to the job", by_sigterm),
    "deadline": ("local scheduler, the attempt's deadline", by_deadline),
    "slurm": ("real local SLURM, scontrol requeue", by_slurm_requeue),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--scenario", nargs="+", choices=sorted(SCENARIOS), default=["sigterm", "deadline", "slurm"]
    )
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="the smallest sizes, in seconds: that it runs (make test), no figures",
    )
    args = ap.parse_args()
    if args.smoke:
        global REPEATS
        args.scenario, REPEATS = ["sigterm"], 1
    print(
        f"machine: {os.cpu_count()} cores; load average before: {' '.join(f'{x:.1f}' for x in os.getloadavg())}"
    )
    torch_before = import_torch_s()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        cli("data", "synth", str(work / "data"), "--samples", "512", cwd=work)
        for name in args.scenario:
            title, fn = SCENARIOS[name]
            if name == "slurm" and subprocess.run(["sinfo"], capture_output=True).returncode != 0:
                print(f"\n{title}: skipped (no SLURM cluster answers here; scripts/local-slurm up)")
                continue
            lock = slurm_lock() if name == "slurm" else contextlib.nullcontext()
            with lock:
                run, signalled, extra = fn(work, work / "data")
            results[name] = (title, breakdown(run, work, signalled), extra)
        loaded = load_s(work / "runs" / next(iter(results)), work) if results else float("nan")
    torch_s = statistics.median([torch_before, import_torch_s()])
    for title, b, extra in results.values():
        print(f"\n{title}:")
        for label, seconds in b["rows"]:
            print(f"  {label:<72} {seconds:6.2f} s")
        print(f"  {'total: stop signal -> end of the continuation first step':<72} {b['total']:6.2f} s")
        if "slurm" in extra:
            s = extra["slurm"]
            print(
                f"  SLURM after the requeue: eligible {s['EligibleTime']}, started {s['StartTime']} "
                f"(the queue row above is SLURM's hold + scheduling), restarts {s['Restarts']}"
            )
        rest = b["total"] - b["save"] - loaded
        print(
            f"  save + load = {b['save']:.2f} + {loaded:.2f} s; the rest {rest:.2f} s = "
            f"{rest / torch_s:.1f} x the machine's process start-up ({torch_s:.2f} s); goal <= 1 x: "
            + ("met" if rest <= torch_s else "not met")
        )
    print(f'\npython -c "import torch" (median of 6 in this run): {torch_s:.2f} s')
    inside, more, exit_s = process_parts_s()
    print(
        f"inside one process (median of 3): import torch {inside:.2f} s, then mmdit + DCP {more:.2f} s "
        f"(the trainer's other imports); exit with them loaded {exit_s:.2f} s"
    )
    print(f"checkpoint load of the same state (one process, the trainer's resume): {loaded:.2f} s")
    print(f"load average after: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
