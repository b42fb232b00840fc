"""Training time lost to asynchronous periodic checkpoints: the trainer's real step, two ranks.

Two gloo ranks (torchrun; ``--ranks``) build hpclaunch's ``Trainer`` (real model, DDP, AdamW, data, DCP
checkpointer) and alternate, round by round (ABBA order against drifting background load):

  steady: ``(m + 1) * k`` training steps, no saves;
  saving: the same number of steps with ``Trainer.save(blocking=False)`` after every ``k``-th step
          (``m`` saves), then a wait for the last save to be published; once with the writer
          thread at ``checkpoint.writer_nice`` (default +10) and once at training's own priority. Everything the background
          writer costs is inside: the staging copy, the DCP write, sha256 of every file, the
          manifest, the rename, retention, and the CPU, memory bandwidth and GIL it takes from
          the training thread while steps run beside it.

Seconds of training lost per save = (saving - steady) / m, per round (median reported), compared
with the time of one synchronous save of the same state (``Trainer.save(blocking=True)``), also
measured every round. Goal: lost per save <= 0.05 x synchronous save. Figures only, no assertions.

    .venv/bin/python bench/checkpoint_stall.py [--rounds 20] [--every 20] [--saves 1] [--ranks 2]
        [--set model.depth=4 ...]
"""

from __future__ import annotations

import argparse
import itertools
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
# save takes ~0.5 s here) while a step stays short enough for many paired rounds.
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
    # many short paired rounds: on a shared machine the background load drifts within seconds
    ap.add_argument(
        "--rounds", type=int, default=20, help="ABBA rounds (each: steady, saving, one sync save)"
    )
    ap.add_argument("--every", type=int, default=20, help="steps between periodic saves (k)")
    ap.add_argument("--saves", type=int, default=1, help="periodic saves per round (m)")
    ap.add_argument("--ranks", type=int, default=2, help="gloo ranks (1 leaves a core free for the writer)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--dir", type=Path, default=None, help="where the run (and checkpoints) go")
    ap.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
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
            f"--saves={args.saves}",
        ]  # fmt: skip
        out = subprocess.run(argv, capture_output=True, text=True, cwd=root)
        if out.returncode != 0:
            raise SystemExit(f"the ranks failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
        result = json.loads(out.stdout.strip().splitlines()[-1])
    report(result, args)


def report(r: dict[str, Any], args: argparse.Namespace) -> None:
    k, m = args.every, args.saves
    print(
        f"model: {r['params'] / 1e6:.2f} M parameters, checkpoint {r['bytes'] / 1e6:.0f} MB ({args.ranks} gloo ranks, "
        f"torch threads 1 per rank), step {r['step_s'] * 1e3:.0f} ms; {m} saves every {k} steps per round"
    )
    nice = r["rounds"][0]["nice"]
    print(
        f"{'round':>5} {'steady s':>9} {'saving s':>9} {'lost/save s':>12} {'at nice 0 s':>12} "
        f"{'lost/save s':>12} {'sync save s':>12}"
    )
    for i, row in enumerate(r["rounds"], 1):
        lost = (row["saving"] - row["steady"]) / m
        plain = (row["saving_plain"] - row["steady"]) / m
        print(
            f"{i:>5} {row['steady']:>9.2f} {row['saving']:>9.2f} {lost:>12.3f} "
            f"{row['saving_plain']:>12.2f} {plain:>12.3f} {row['sync']:>12.3f}"
        )
    losses = sorted((row["saving"] - row["steady"]) / m for row in r["rounds"])
    lost = statistics.median(losses)
    q1, _, q3 = statistics.quantiles(losses, n=4) if len(losses) > 1 else (lost, lost, lost)
    plain = statistics.median((row["saving_plain"] - row["steady"]) / m for row in r["rounds"])
    sync = statistics.median(row["sync"] for row in r["rounds"])
    stall = statistics.median(r["stalls"]) if r["stalls"] else float("nan")
    write = statistics.median(r["writes"]) if r["writes"] else float("nan")
    print(f"blocking part of an async save (stall_s, median): {stall:.3f} s")
    if r.get("after_save_step_s") and r.get("other_step_s"):
        print(
            f"rank 0's step right after a save (the writer starts beside it), median: "
            f"{r['after_save_step_s'] * 1e3:.0f} ms vs {r['other_step_s'] * 1e3:.0f} ms for the other steps"
        )
    print(
        f"its background write (median): {write:.3f} s, beside {k} steps "
        f"({k * r['step_s']:.2f} s at the steady step time)"
        + ("  <- longer than the interval: the next save waits for it" if write > k * r["step_s"] else "")
    )
    print(
        f"training lost per async save, writer at nice +{nice} (checkpoint.writer_nice; median of rounds): "
        f"{lost:.3f} s (quartiles {q1:.3f}, {q3:.3f})"
    )
    print(f"training lost per async save, writer at training's priority (nice +0): {plain:.3f} s")
    print(f"synchronous save of the same state (median): {sync:.3f} s")
    print(
        f"lost per async save / synchronous save: {lost / sync:.3f} at nice +{nice} (goal <= 0.05), {plain / sync:.3f} at +0"
    )
    print(f"load average after: {load()}")


# ---- the ranks ------------------------------------------------------------------------------------


def worker(run: Path, *, rounds: int, every: int, saves: int) -> None:
    import torch
    import torch.distributed as dist

    from hpclaunch.rundir import RunPaths, read_config
    from hpclaunch.trainer.loop import Trainer

    torch.set_num_threads(1)
    paths = RunPaths(run)
    trainer = Trainer(read_config(paths), paths, attempt="bench", echo=False)
    group = trainer.ctx.cpu_group
    ckpt = trainer.checkpointer
    assert ckpt is not None

    after_save: list[float] = []  # each step right after an async save (where the writer starts)
    others: list[float] = []  # every other step of the saving arms

    def steps(n: int, *, save_every: int | None = None) -> float:
        dist.barrier(group=group)
        t0 = time.perf_counter()
        for i in range(1, n + 1):
            s0 = time.perf_counter()
            trainer.train_step()
            if save_every:
                (after_save if i % save_every == 1 and i > 1 else others).append(time.perf_counter() - s0)
            if save_every and i % save_every == 0 and i < n:
                trainer.save(blocking=False)
        ckpt.wait()  # the last save is published inside the measured time
        dist.barrier(group=group)
        return time.perf_counter() - t0

    def sync_save() -> float:
        dist.barrier(group=group)
        t0 = time.perf_counter()
        trainer.save(blocking=True)
        dist.barrier(group=group)
        return time.perf_counter() - t0

    n = (saves + 1) * every
    steps(every)  # warm-up: allocator, kernels
    steps(2 * every, save_every=every)  # warm-up: the stager's buffers, DCP's first plan
    sync_save()
    after_save.clear()
    others.clear()
    stalls: list[float] = []
    writes: list[float] = []
    rows = []
    niced = ckpt.writer_nice  # checkpoint.writer_nice (the default, or --set)

    def saving_at(nice: int) -> float:
        ckpt.writer_nice = nice
        try:
            return steps(n, save_every=every)
        finally:
            ckpt.writer_nice = niced

    arms = {
        "steady": lambda: steps(n),
        "saving": lambda: saving_at(niced),
        "saving_plain": lambda: saving_at(0),  # the writer at training's own priority
    }
    orders = list(itertools.permutations(arms))  # every order in turn, against drifting load
    for r in range(rounds):
        row = {name: arms[name]() for name in orders[r % len(orders)]}
        stalls.append(float(ckpt.last_stall_seconds or 0.0))
        writes.append(float(ckpt.last_save_seconds or 0.0))  # the background write of the last save
        rows.append({**row, "sync": sync_save(), "nice": niced})
    if trainer.ctx.rank == 0:
        newest = sorted(p for p in run.joinpath("checkpoints").glob("step_*") if p.is_dir())[-1]
        size = sum(f.stat().st_size for f in newest.rglob("*") if f.is_file())
        print(
            json.dumps(
                {
                    "params": sum(p.numel() for p in trainer.model.parameters()),
                    "bytes": size,
                    "step_s": min(row["steady"] for row in rows) / n,
                    "rounds": rows,
                    "stalls": stalls,
                    "writes": writes,
                    "after_save_step_s": statistics.median(after_save) if after_save else None,
                    "other_step_s": statistics.median(others) if others else None,
                }
            ),
            flush=True,
        )
    trainer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
