"""FSDP2 vs DDP on 2 CPU ranks (torchrun, gloo): step time and peak memory per rank, same model.

For each model size and each ``train.parallel``, 2 ranks run the real trainer's set-up and
``Trainer.train_step`` (model, AdamW, grad clipping; fp32 on CPU) for ``--steps`` steps after
``--warmup``. Per rank: median step time, and peak memory while training = the process's peak
resident set during the steps (``VmHWM``, reset once the trainer is built: the model is built whole
on the CPU before FSDP shards it, a one-off not counted here) minus its resident set before the
trainer was built (torch and the process group are in both). Printed beside it: preflight's
estimate of the training state (parameters + gradients + optimizer state) under that sharding.

Two sizes: ``small`` (the default tiny model: the price of sharding when nothing needs it) and
``large`` (~100M parameters: weights, gradients, DDP's gradient buckets and AdamW's moments are
~2 GB per DDP rank, so the per-rank budget ``--budget-gb`` (default 1.5 GB) is exceeded by DDP and
met by FSDP, which keeps half of the 16 bytes a parameter on each of the 2 ranks).

    .venv/bin/python bench/fsdp_vs_ddp.py [--steps 4] [--budget-gb 1.0] [--sizes small,large]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SIZES = {
    "small": [],
    "large": [
        "model.depth=6",
        "model.dim_text=768",
        "model.dim_latent=768",
        "model.dim_cond=256",
        "model.heads=12",
        "model.dim_head=64",
    ],
}
COMMON = [
    "train.global_batch=4",
    "train.warmup_steps=0",
    "train.log_every=1000",
    "data.num_workers=0",
    "preflight.distributed_smoke=false",
    "scheduler.procs_per_node=2",
]


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    """VmHWM: the peak resident set since the process started or since ``reset_peak``."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # Linux: reset VmHWM to the current RSS


def worker(args: argparse.Namespace) -> None:
    """One rank: build the trainer, time train_step, report step times and memory."""
    import torch

    from hpclaunch.config import load_config
    from hpclaunch.rank.tensors import local
    from hpclaunch.rundir import RunPaths
    from hpclaunch.trainer.loop import Trainer

    torch.set_num_threads(1)
    cfg = load_config(
        None,
        [
            *COMMON,
            *SIZES[args.size],
            f"train.parallel={args.parallel}",
            f"train.steps={args.steps + args.warmup}",
            f"data.token_dir={args.data}/tokens",
            f"data.latent_dir={args.data}/latents",
        ],
    )
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo")  # before the baseline: the group is in both figures
    baseline = rss_bytes()  # after imports and the process group; before data and model
    trainer = Trainer(
        cfg,
        RunPaths(Path(args.out) / f"run-{args.parallel}-{args.size}").ensure(),
        checkpoints=False,
        echo=False,
    )
    reset_peak()
    times = []
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        trainer.train_step()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    peak = peak_rss_bytes()
    mine = sum(local(p).numel() for p in trainer.model.parameters())
    full = sum(torch.Size(p.shape).numel() for p in trainer.model.parameters())  # global shapes
    rank = trainer.ctx.rank
    trainer.close()
    result = {
        "rank": rank,
        "step_s": statistics.median(times),
        "peak_bytes": peak - baseline,
        "local_params": mine,
        "params": full,
    }
    Path(args.out, f"{args.parallel}-{args.size}-rank{rank}.json").write_text(json.dumps(result))
    if dist.is_initialized():
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--budget-gb", type=float, default=1.5)
    ap.add_argument("--sizes", default="small,large")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--parallel", help=argparse.SUPPRESS)
    ap.add_argument("--size", help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="the smallest sizes, in seconds: that it runs (make test), no figures",
    )
    args = ap.parse_args()
    if args.smoke:
        args.steps, args.warmup, args.sizes = 1, 1, "small"
    if args.worker:
        worker(args)
        return
    from hpclaunch.config import load_config
    from hpclaunch.preflight.sizes import estimate_memory, human_bytes
    from hpclaunch.shards import synth_dataset

    budget = args.budget_gb * 1e9
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        synth_dataset(data, samples=256, seed=0, model_cfg=load_config(None).model)
        print(
            f"2 CPU ranks (gloo), fp32, global batch 4, {args.steps} timed steps after {args.warmup}; per-rank budget {args.budget_gb} GB"
        )
        for size in args.sizes.split(","):
            rows = {}
            for parallel in ("ddp", "fsdp"):
                cmd = [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--standalone",
                    "--nproc-per-node=2",
                    __file__,
                    "--worker",
                    f"--parallel={parallel}",
                    f"--size={size}",
                    f"--data={data}",
                    f"--out={tmp}",
                    f"--steps={args.steps}",
                    f"--warmup={args.warmup}",
                ]
                proc = subprocess.run(
                    cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}
                )
                if proc.returncode:
                    sys.exit(f"{parallel}/{size} failed:\n{proc.stderr[-3000:]}")
                ranks = [json.loads(Path(tmp, f"{parallel}-{size}-rank{r}.json").read_text()) for r in (0, 1)]
                cfg = load_config(
                    None, [*COMMON, *SIZES[size], f"train.parallel={parallel}", "train.precision=fp32"]
                )
                est = estimate_memory(cfg, ranks[0]["params"]).parts
                state = est["parameters"] + est["gradients"] + est["optimizer"]
                rows[parallel] = (
                    max(r["step_s"] for r in ranks),
                    max(r["peak_bytes"] for r in ranks),
                    state,
                    ranks[0]["params"],
                )
            (ddp_t, ddp_m, _, n), (fsdp_t, fsdp_m, _, _) = rows["ddp"], rows["fsdp"]
            print(f"{size} model, {n / 1e6:.1f}M parameters:")
            for name, (t, m, e, _) in rows.items():
                fits = "fits" if m <= budget else "does NOT fit"
                print(
                    f"  {name:>4}: step {t * 1000:8.1f} ms, peak memory per rank {human_bytes(m):>10} ({fits} {args.budget_gb} GB; estimated state {human_bytes(e)})"
                )
            print(f"  fsdp/ddp: step time {fsdp_t / ddp_t:.2f}x, peak memory {fsdp_m / ddp_m:.2f}x")


if __name__ == "__main__":
    main()
