"""Training time lost to asynchronous periodic checkpoints, thread writer vs process writer, in one run.

Two gloo ranks (torchrun; ``--ranks``) build hpclaunch's ``Trainer`` (real model, DDP, AdamW, DCP)
and one checkpointer per writer beside it (``checkpoint.writer: thread`` and ``process``, each into
its own directory). They train in intervals of ``k`` steps, in a repeating cycle

  steady, thread, steady, process, steady, sync

where a writer's interval starts with ``Trainer.save(blocking=False)`` through that writer, polls
after every step as the training loop does, and ends by waiting for the save to be published (time
that counts), and ``sync`` is one synchronous save (``Trainer.save(blocking=True)``) of the same
state. Training lost by one async save = the ``save()`` call + the final wait + the sum over the
interval's steps of (step time - the median step of the two steady intervals around it). The steady
intervals a second away are the baseline, so other load on a shared machine, which drifts over
seconds, cancels out much better than between whole runs. Where it goes, per writer: the state
dict (``Trainer.app_state``), planning (rank 0's decision, a broadcast), staging (the copy; for the
process writer also handing it over) and the writer's interference with training (the steps beside
it ran slower, and any wait at the end). Each is also printed as a ratio to the synchronous save
measured in the same cycles. Medians over cycles; figures only, no assertions.

    .venv/bin/python bench/checkpoint_stall.py [--rounds 30] [--every 20] [--ranks 2] [--nice-arm]
        [--set model.depth=4 ...]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# A model whose state (weights + two AdamW moments) is ~35 MB: saving it is real work (a synchronous
# save takes ~0.3 s here) while a step stays short enough for many paired rounds.
MODEL = (
    "model.depth=3",
    "model.dim_text=160",
    "model.dim_latent=160",
    "model.dim_cond=160",
    "model.heads=4",
    "model.dim_head=40",
    "train.global_batch=8",
    "train.micro_batch=4",
)
# Arms: name -> (checkpoint.writer, checkpoint.writer_idle). "process-nice": the process writer at
# checkpoint.writer_nice instead of SCHED_IDLE (``--nice-arm``), to show what the priority does.
ARMS = {"thread": ("thread", False), "process": ("process", True), "process-nice": ("process", False)}
WRITERS: tuple[str, ...] = ("thread", "process")
PARTS = ("state_dict", "plan", "stage")


def machine() -> str:
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if "model name" in line
        ),
        platform.processor() or "?",
    )
    return f"{os.cpu_count()} cores ({cpu}), {platform.system()} {platform.release()}"


def load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


# ---- the launcher ---------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--rounds", type=int, default=30, help="cycles (steady, thread, steady, process, steady, sync)"
    )
    ap.add_argument("--every", type=int, default=20, help="steps per interval (k)")
    ap.add_argument("--saves", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--ranks", type=int, default=2, help="gloo ranks")
    ap.add_argument(
        "--quiet", type=float, default=0.15, help="leave out cycles with more other load (cores) than this"
    )
    ap.add_argument(
        "--nice-arm", action="store_true", help="also the process writer at writer_nice, not idle"
    )
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--dir", type=Path, default=None, help="where the run (and checkpoints) go")
    ap.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="the smallest sizes, in seconds: that it runs (make test), no figures",
    )
    args = ap.parse_args()
    if args.smoke:
        args.rounds, args.every = 1, 2
    global WRITERS
    if args.nice_arm:
        WRITERS = ("thread", "process", "process-nice")
    if args.worker is not None:
        worker(args.worker, rounds=args.rounds, every=args.every, saves=args.saves)
        return
    from hpclaunch.config import load_config
    from hpclaunch.shards import synth_dataset

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp)
        overrides = [*MODEL, *args.overrides]
        base = load_config(None, overrides)
        synth_dataset(root / "data", samples=512, seed=0, model_cfg=base.model)
        run = root / "run"
        cfg = load_config(
            None,
            [
                *overrides,
                f"run_dir={run}",
                f"data.token_dir={root / 'data/tokens'}",
                f"data.latent_dir={root / 'data/latents'}",
                "checkpoint.keep_last=2",
                "preflight.distributed_smoke=false",
            ],
            base=root,
        )
        run.mkdir(parents=True)
        (run / "config.yaml").write_text(json.dumps(cfg.to_dict()))  # JSON is YAML
        print(f"machine: {machine()}; load average before: {load()}")
        argv = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.ranks}",
            __file__, "--worker", str(run), f"--rounds={args.rounds}", f"--every={args.every}",
            f"--saves={args.saves}", *(["--nice-arm"] if args.nice_arm else []),
        ]  # fmt: skip
        out = subprocess.run(argv, capture_output=True, text=True, cwd=root)
        if out.returncode != 0:
            raise SystemExit(f"the ranks failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
        result = json.loads(out.stdout.strip().splitlines()[-1])
    report(result, args)


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def lost(cycle: dict[str, Any], writer: str) -> dict[str, float]:
    """One async save's cost: its interval's steps against the mean step of the steady intervals
    around it (the mean, not the median: a sum of steps is compared), plus its call and its wait."""
    i = WRITERS.index(writer)
    around = cycle["steady"][i]["steps"] + cycle["steady"][i + 1]["steps"]
    base = statistics.fmean(around)
    iv = cycle[writer]
    excess = sum(dt - base for dt in iv["steps"])
    return {
        "lost": iv["call"] + excess + iv["wait"],
        "interference": excess + iv["wait"],
        "first_step": iv["steps"][0] - base,
    }


def placebo(cycle: dict[str, Any]) -> float:
    """The same measure for a steady interval against its neighbours: what the method reads when
    nothing is saved (its bias and noise), printed beside the writers."""
    first, middle, last = cycle["steady"][:3]
    base = statistics.fmean(first["steps"] + last["steps"])
    return sum(dt - base for dt in middle["steps"])


def foreign_cores(cycle: dict[str, Any]) -> float:
    """The most other load (cores busy with processes not of this bench) in any of the cycle's
    intervals."""
    ivs = [*cycle["steady"], *(cycle[w] for w in WRITERS)]
    return max((iv["machine"] - iv["ours"]) / iv["wall"] for iv in ivs)


def report(r: dict[str, Any], args: argparse.Namespace) -> None:
    k = args.every
    every_cycle = r["cycles"]
    quiet = [c for c in every_cycle if foreign_cores(c) <= args.quiet]
    print(
        f"cycles with other load <= {args.quiet:g} cores (the rest left out): {len(quiet)} of {len(every_cycle)}; "
        f"other load in all cycles, median {median([foreign_cores(c) for c in every_cycle]):.2f} cores"
    )
    if not quiet:
        print("no quiet cycle: figures over all cycles (other load disturbs them)")
        quiet = every_cycle
    cycles = quiet
    print(
        f"model: {r['params'] / 1e6:.2f} M parameters, checkpoint {r['bytes'] / 1e6:.0f} MB ({args.ranks} gloo "
        f"ranks, torch threads 1 per rank), step {r['step_s'] * 1e3:.0f} ms; one save per {k}-step interval; "
        f"{len(cycles)} cycles; thread writer at nice +{r['nice']}, process writer at SCHED_IDLE"
        + (f" (process-nice: at nice +{r['nice']})" if "process-nice" in WRITERS else "")
    )
    print(
        f"{'cycle':>5} "
        + " ".join(f"{w + ' lost s':>20}" for w in WRITERS)
        + f" {'sync save s':>12} {'other load':>10}"
    )
    for i, cyc in enumerate(every_cycle, 1):
        mark = "" if cyc in cycles else "  (left out)"
        print(
            f"{i:>5} "
            + " ".join(f"{lost(cyc, w)['lost']:>20.3f}" for w in WRITERS)
            + f" {cyc['sync']:>12.3f} {foreign_cores(cyc):>10.2f}{mark}"
        )
    sync = median([cyc["sync"] for cyc in cycles])
    print(f"\nsynchronous save of the same state (median): {sync:.3f} s")
    print(f"{'where a save goes (median s, / sync save)':<46}" + "".join(f"{w:>22}" for w in WRITERS))
    table: dict[str, dict[str, float]] = {}
    for w in WRITERS:
        ivs = [cyc[w] for cyc in cycles]
        costs = [lost(cyc, w) for cyc in cycles]
        table[w] = {
            **{p: median([iv[p] for iv in ivs]) for p in PARTS},
            "interference": median([c["interference"] for c in costs]),
            "lost": median([c["lost"] for c in costs]),
            "first_step": median([c["first_step"] for c in costs]),
            "write": median([iv["write"] for iv in ivs]),
            "cpu": median([iv["cpu"] for iv in ivs if iv.get("cpu") is not None]),
        }
    labels = {
        "state_dict": "state dict (Trainer.app_state)",
        "plan": "planning (rank 0's decision, broadcast)",
        "stage": "staging copy (+ hand-over to the writer)",
        "interference": "writer's interference with training",
        "lost": "training lost per save",
    }
    for key, label in labels.items():
        cells = "".join(f"{table[w][key]:>12.3f} ({table[w][key] / sync:>6.3f})" for w in WRITERS)
        print(f"{label:<46}{cells}")
    rows = {
        "background write (beside training)": "write",
        "writer process CPU time per save (a rank's)": "cpu",
        "first step after a save: slower by": "first_step",
    }
    for label, key in rows.items():
        print(f"{label:<46}" + "".join(f"{table[w][key]:>22.3f}" for w in WRITERS))
    checks = sorted(placebo(cyc) for cyc in cycles)
    print(
        f"method check: a steady interval measured the same way (nothing saved) reads {median(checks):+.3f} s "
        f"(quartiles {statistics.quantiles(checks, n=4)[0]:+.3f} .. {statistics.quantiles(checks, n=4)[2]:+.3f})"
        if len(checks) > 1
        else ""
    )
    for w in WRITERS:
        losses = [lost(cyc, w)["lost"] for cyc in cycles]
        q1, _, q3 = statistics.quantiles(losses, n=4) if len(losses) > 1 else (losses[0],) * 3
        print(
            f"training lost per async save / synchronous save, {w} writer: {table[w]['lost'] / sync:.3f} "
            f"(lost {table[w]['lost']:.3f} s, quartiles {q1:.3f} .. {q3:.3f} s)"
        )
    print(f"load average after: {load()}")


# ---- the ranks ------------------------------------------------------------------------------------

TICK = os.sysconf("SC_CLK_TCK")


def _cpu_s(pid: int | str) -> float:
    """utime + stime of a process (all its threads), seconds; 0 when it has gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICK


def _machine() -> tuple[float, float]:
    """(busy, total) CPU seconds of the machine so far, all cores."""
    v = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    total = sum(v[:8])
    return (total - v[3] - v[4]) / TICK, total / TICK


class Usage:
    """CPU used in an interval by the machine, and by this rank and its writer processes: the rest
    is other load (other users of a shared machine), which the report can leave out."""

    def __init__(self, writer_pids: list[int | None]) -> None:
        self.pids: list[int | str] = ["self", *[p for p in writer_pids if p]]
        self.start = sum(_cpu_s(p) for p in self.pids)
        self.busy, self.total = _machine()
        self.t0 = time.perf_counter()

    def ours(self) -> float:
        return sum(_cpu_s(p) for p in self.pids) - self.start

    def machine(self) -> tuple[float, float]:
        busy, _ = _machine()
        return busy - self.busy, time.perf_counter() - self.t0


def worker(run: Path, *, rounds: int, every: int, saves: int) -> None:
    from dataclasses import replace

    import torch
    import torch.distributed as dist

    from hpclaunch.rank.checkpoint import Checkpointer, WriterSettings
    from hpclaunch.rank.dist import all_gather_json
    from hpclaunch.rundir import RunPaths, read_config
    from hpclaunch.trainer.loop import Trainer

    torch.set_num_threads(1)
    paths = RunPaths(run)
    cfg = read_config(paths)
    trainer = Trainer(cfg, paths, attempt="bench", echo=False)
    group = trainer.ctx.cpu_group
    sync_ckpt = trainer.run_state.saves.checkpointer
    assert sync_ckpt is not None
    c = cfg.checkpoint
    writers = {
        w: Checkpointer(
            replace(sync_ckpt.run, directory=run / f"checkpoints-{w}", keep_every=None),
            rank=trainer.ctx.rank,
            writing=WriterSettings(writer=ARMS[w][0], nice=c.writer_nice, idle=ARMS[w][1]),  # type: ignore[arg-type]
        )
        for w in WRITERS
    }
    state_dict_s = [0.0]
    disk = trainer.run_state.saves.disk  # the run's saves: the checkpointer they write through is swapped
    assert disk is not None
    original_state = disk.state

    def timed_state() -> Any:
        t0 = time.perf_counter()
        state = original_state()
        state_dict_s[0] = time.perf_counter() - t0
        return state

    disk.state = timed_state

    def use(ckpt: Any) -> None:
        disk.checkpointer = ckpt
        trainer.run_state.saves.checkpointer = ckpt

    def interval(writer: str | None) -> dict[str, Any]:
        """``every`` steps; with a writer, a background save first and its wait at the end."""
        ckpt = writers[writer] if writer else None
        use(ckpt or sync_ckpt)
        dist.barrier(group=group)
        usage = Usage([w.writer_pid for w in writers.values()])
        out: dict[str, Any] = {"steps": []}
        if ckpt is not None:
            t0 = time.perf_counter()
            trainer.save(blocking=False)
            out["call"] = time.perf_counter() - t0
            out["state_dict"] = state_dict_s[0]
            out["plan"] = ckpt.last_stall_parts.get("plan", 0.0)
            out["stage"] = ckpt.last_stall_parts.get("stage", 0.0)
        for _ in range(every):
            s0 = time.perf_counter()
            trainer.train_step()
            if ckpt is not None:
                trainer.act_on_failed_background_save()  # the loop's poll after every step
            out["steps"].append(time.perf_counter() - s0)
        if ckpt is not None:
            t0 = time.perf_counter()
            ckpt.wait()
            dist.barrier(group=group)
            out["wait"] = time.perf_counter() - t0
            out["write"] = float(ckpt.last_save_seconds or 0.0)
            out["cpu"] = ckpt.last_writer_cpu_seconds
        else:
            dist.barrier(group=group)
        mine = usage.ours()  # this rank's and its writers' CPU seconds in the interval
        out["ours"] = sum(all_gather_json(mine, trainer.ctx.host_group()))
        out["machine"], out["wall"] = usage.machine()
        return out

    def sync_save() -> float:
        use(sync_ckpt)
        dist.barrier(group=group)
        t0 = time.perf_counter()
        trainer.save(blocking=True)
        dist.barrier(group=group)
        return time.perf_counter() - t0

    interval(None)  # warm-up: allocator, kernels
    for w in WRITERS:  # warm-up: the writer process's start, the stagers' buffers, DCP's first plan
        interval(w)
        interval(w)
    sync_save()
    cycles = []
    for _ in range(rounds):
        cycle: dict[str, Any] = {"steady": [interval(None)]}
        for w in WRITERS:
            cycle[w] = interval(w)
            cycle["steady"].append(interval(None))
        cycle["sync"] = sync_save()
        cycles.append(cycle)
    if trainer.ctx.rank == 0:
        newest = sorted(p for p in run.joinpath("checkpoints").glob("step_*") if p.is_dir())[-1]
        size = sum(f.stat().st_size for f in newest.rglob("*") if f.is_file())
        steady = [statistics.median(iv["steps"]) for cyc in cycles for iv in cyc["steady"]]
        print(
            json.dumps(
                {
                    "params": sum(p.numel() for p in trainer.model.parameters()),
                    "bytes": size,
                    "step_s": statistics.median(steady),
                    "nice": c.writer_nice,
                    "cycles": cycles,
                }
            ),
            flush=True,
        )
    for ckpt in writers.values():
        ckpt.close()
    use(sync_ckpt)
    trainer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
