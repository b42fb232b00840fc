"""Training time lost to asynchronous periodic checkpoints, thread writer vs process writer, in one run.

Two gloo ranks (torchrun; ``--ranks``) build hpclaunch's ``Trainer`` (real model, DDP, AdamW, data,
DCP) and two checkpointers beside it, one per writer (``checkpoint.writer: thread`` and ``process``,
each into its own directory). Round by round, in a rotating order against drifting background load:

  steady:  ``(m + 1) * k`` training steps, no saves;
  thread:  the same steps with ``Trainer.save(blocking=False)`` after every ``k``-th (``m`` saves)
           through the thread writer, then a wait for the last save to be published;
  process: the same through the process writer;
  sync:    one synchronous save of the same state (``Trainer.save(blocking=True)``).

Training lost per save = (arm - steady) / m: everything a background save costs the ranks is inside
(building the state dict, rank 0's decision, the staging copy, and the CPU, memory bandwidth and,
for the thread, the GIL the writer takes from the steps beside it). Where it goes, per writer:
the state dict (``Trainer.app_state``), planning (rank 0's decision, a broadcast), staging (the copy;
for the process writer also handing it over), and the writer's interference with training (the rest
of the loss: the steps beside the writer ran slower). Each is printed as a ratio to the synchronous
save measured in the same rounds. Medians over rounds; figures only, no assertions.

    .venv/bin/python bench/checkpoint_stall.py [--rounds 12] [--every 20] [--saves 1] [--ranks 2]
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
    ap.add_argument("--rounds", type=int, default=12, help="rounds (each: steady, thread, process, sync)")
    ap.add_argument("--every", type=int, default=20, help="steps between periodic saves (k)")
    ap.add_argument("--saves", type=int, default=1, help="periodic saves per arm (m)")
    ap.add_argument("--ranks", type=int, default=2, help="gloo ranks")
    ap.add_argument(
        "--nice-arm", action="store_true", help="also the process writer at writer_nice, not idle"
    )
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--dir", type=Path, default=None, help="where the run (and checkpoints) go")
    ap.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
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


def report(r: dict[str, Any], args: argparse.Namespace) -> None:
    k, m = args.every, args.saves
    print(
        f"model: {r['params'] / 1e6:.2f} M parameters, checkpoint {r['bytes'] / 1e6:.0f} MB ({args.ranks} gloo "
        f"ranks, torch threads 1 per rank), step {r['step_s'] * 1e3:.0f} ms; {m} save(s) every {k} steps per "
        f"arm; thread writer at nice +{r['nice']}, process writer at SCHED_IDLE"
        + (f" (process-nice: at nice +{r['nice']})" if "process-nice" in WRITERS else "")
    )
    rows = r["rounds"]
    print(
        f"{'round':>5} {'steady s':>9} "
        + " ".join(f"{w + ' lost/save s':>22}" for w in WRITERS)
        + f" {'sync save s':>12}"
    )
    for i, row in enumerate(rows, 1):
        lost = [(row[w] - row["steady"]) / m for w in WRITERS]
        print(
            f"{i:>5} {row['steady']:>9.2f} "
            + " ".join(f"{x:>22.3f}" for x in lost)
            + f" {row['sync']:>12.3f}"
        )
    sync = median([row["sync"] for row in rows])
    print(f"\nsynchronous save of the same state (median): {sync:.3f} s")
    print(f"{'where a save goes (median s, / sync save)':<46}" + "".join(f"{w:>22}" for w in WRITERS))
    table: dict[str, dict[str, float]] = {}
    for w in WRITERS:
        lost = median([(row[w] - row["steady"]) / m for row in rows])
        parts = {p: median(r["parts"][w][p]) for p in PARTS}
        call = median(r["parts"][w]["call"])
        table[w] = {
            **parts,
            "interference": lost - call,
            "lost": lost,
            "write": median(r["parts"][w]["write"]),
            "cpu": median(r["parts"][w]["cpu"]),
            "after": median(r["steps"][w]["after"]),
            "other": median(r["steps"][w]["other"]),
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
    print(
        f"{'background write (not lost: beside training)':<46}"
        + "".join(f"{table[w]['write']:>22.3f}" for w in WRITERS)
    )
    print(
        f"{'writer process CPU time per save (each rank)':<46}"
        + "".join(f"{table[w]['cpu']:>22.3f}" for w in WRITERS)
    )
    print(
        f"{'step right after a save vs others (ms)':<46}"
        + "".join(f"{table[w]['after'] * 1e3:>13.0f} vs {table[w]['other'] * 1e3:>4.0f}" for w in WRITERS)
    )
    for w in WRITERS:
        losses = sorted((row[w] - row["steady"]) / m for row in rows)
        q1, _, q3 = statistics.quantiles(losses, n=4) if len(losses) > 1 else (losses[0],) * 3
        print(
            f"training lost per async save / synchronous save, {w} writer: {table[w]['lost'] / sync:.3f} "
            f"(lost {table[w]['lost']:.3f} s, quartiles {q1:.3f} .. {q3:.3f} s)"
        )
    print(f"load average after: {load()}")


# ---- the ranks ------------------------------------------------------------------------------------


def worker(run: Path, *, rounds: int, every: int, saves: int) -> None:
    import torch
    import torch.distributed as dist

    from hpclaunch.rundir import RunPaths, read_config
    from hpclaunch.trainer.checkpoint import Checkpointer
    from hpclaunch.trainer.loop import Trainer

    torch.set_num_threads(1)
    paths = RunPaths(run)
    cfg = read_config(paths)
    trainer = Trainer(cfg, paths, attempt="bench", echo=False)
    group = trainer.ctx.cpu_group
    sync_ckpt = trainer.checkpointer
    assert sync_ckpt is not None
    c = cfg.checkpoint
    writers = {
        w: Checkpointer(
            run / f"checkpoints-{w}",
            rank=trainer.ctx.rank,
            world_size=trainer.ctx.world_size,
            config_hash=cfg.config_hash(),
            model_hash=cfg.model_hash(),
            keep_last=c.keep_last,
            writer=ARMS[w][0],  # type: ignore[arg-type]
            writer_nice=c.writer_nice,
            writer_idle=ARMS[w][1],
        )
        for w in WRITERS
    }
    parts: dict[str, dict[str, list[float]]] = {
        w: {p: [] for p in (*PARTS, "call", "write", "cpu")} for w in WRITERS
    }
    steps_after: dict[str, dict[str, list[float]]] = {w: {"after": [], "other": []} for w in WRITERS}
    measuring = False

    def timed_app_state() -> Any:
        t0 = time.perf_counter()
        state = original_app_state()
        timed_app_state.seconds = time.perf_counter() - t0  # type: ignore[attr-defined]
        return state

    original_app_state = trainer.app_state
    trainer.app_state = timed_app_state  # type: ignore[method-assign]

    def steps(n: int, writer: str | None = None) -> float:
        ckpt = writers[writer] if writer else None
        trainer.checkpointer = ckpt or sync_ckpt
        dist.barrier(group=group)
        t0 = time.perf_counter()
        for i in range(1, n + 1):
            s0 = time.perf_counter()
            trainer.train_step()
            if ckpt is not None and measuring:
                kind = "after" if i % every == 1 and i > 1 else "other"
                steps_after[writer or ""][kind].append(time.perf_counter() - s0)
            if ckpt is not None:
                trainer.act_on_failed_background_save()  # the loop's poll after every step
            if ckpt is not None and i % every == 0 and i < n:
                c0 = time.perf_counter()
                trainer.save(blocking=False)
                if measuring and writer is not None:
                    p = parts[writer]
                    p["call"].append(time.perf_counter() - c0)
                    p["state_dict"].append(timed_app_state.seconds)  # type: ignore[attr-defined]
                    p["plan"].append(ckpt.last_stall_parts.get("plan", 0.0))
                    p["stage"].append(ckpt.last_stall_parts.get("stage", 0.0))
        if ckpt is not None:
            ckpt.wait()  # the last save is published inside the measured time
            if measuring and writer is not None:
                parts[writer]["write"].append(float(ckpt.last_save_seconds or 0.0))
                parts[writer]["cpu"].append(float(ckpt.last_writer_cpu_seconds or "nan"))
        dist.barrier(group=group)
        return time.perf_counter() - t0

    def sync_save() -> float:
        trainer.checkpointer = sync_ckpt
        dist.barrier(group=group)
        t0 = time.perf_counter()
        trainer.save(blocking=True)
        dist.barrier(group=group)
        return time.perf_counter() - t0

    n = (saves + 1) * every
    steps(every)  # warm-up: allocator, kernels
    for w in WRITERS:  # warm-up: the writer process's start, the stagers' buffers, DCP's first plan
        steps(2 * every, w)
    sync_save()
    measuring = True
    arms = ["steady", *WRITERS]
    rows = []
    for r in range(rounds):
        order = arms[r % len(arms) :] + arms[: r % len(arms)]  # rotate: each arm leads in turn
        row = {arm: steps(n, None if arm == "steady" else arm) for arm in order}
        rows.append({**row, "sync": sync_save()})
    if trainer.ctx.rank == 0:
        newest = sorted(p for p in run.joinpath("checkpoints").glob("step_*") if p.is_dir())[-1]
        size = sum(f.stat().st_size for f in newest.rglob("*") if f.is_file())
        print(
            json.dumps(
                {
                    "params": sum(p.numel() for p in trainer.model.parameters()),
                    "bytes": size,
                    "step_s": min(row["steady"] for row in rows) / n,
                    "nice": c.writer_nice,
                    "rounds": rows,
                    "parts": parts,
                    "steps": steps_after,
                }
            ),
            flush=True,
        )
    for ckpt in writers.values():
        ckpt.close()
    trainer.checkpointer = sync_ckpt
    trainer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
