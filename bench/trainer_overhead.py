"""What the hpclaunch training loop costs over a bare PyTorch loop (one process, same seed).

Both loops train the same model (``build_model``, same seed) on the same synthetic data with the
same objective, batch, optimizer and number of steps:

(a) bare: ~20 lines; batches read in order, diffusion times/masks/noise from torch's global RNG;
(b) hpclaunch: ``Trainer.run`` without checkpoints: per-sample deterministic draws, LR schedule,
    NaN guard (one host sync a step), on-device metrics and metrics.jsonl lines, stop checks,
    the failed-background-save check; EMA and validation off (their defaults), and the data read
    in the training process (``--workers 0``, the default here) so that CPU time compares the same
    work: with workers the data path runs in other processes (see ``bench/data_path.py``).

The two alternate for ``--rounds`` rounds of ``--steps`` steps; reported: the best round of
each, and the medians of the per-round ratios by wall time and by process CPU time (paired rounds
see similar background load; CPU time is the least sensitive to other processes on the box).
Figures only, no assertions.

    .venv/bin/python bench/trainer_overhead.py [--steps 60] [--rounds 8] [--set model.depth=4 ...]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from hpclaunch.config import RunConfig, load_config
from hpclaunch.rundir import RunPaths
from hpclaunch.shards import synth_dataset, validate_dataset
from hpclaunch.trainer.data.dataset import ShardedDataset
from hpclaunch.trainer.loop import Trainer
from hpclaunch.trainer.model.mmdit_diffusion import build_model
from hpclaunch.trainer.model.objective import Draws, Objective, compute_losses
from hpclaunch.trainer.setup.parallel import set_deterministic


def bare_loop(cfg: RunConfig, steps: int) -> tuple[float, float]:
    """(wall s, CPU s) of ``steps`` steps of the plainest loop doing the same work (set-up excluded)."""
    t, m = cfg.train, cfg.model
    data = ShardedDataset(validate_dataset(cfg.data.token_dir, cfg.data.latent_dir, m), m)
    model = build_model(m, seed=t.seed)
    params = list(model.parameters())
    opt = torch.optim.AdamW(
        [{"params": [p for p in params if p.ndim >= 2], "weight_decay": t.weight_decay},
         {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
        lr=t.lr, betas=(t.betas[0], t.betas[1]),
    )  # fmt: skip
    b = t.global_batch
    objective = Objective.of(cfg)
    wall, cpu = time.perf_counter(), time.process_time()
    for step in range(steps):
        ids, lat = data.get((np.arange(b) + step * b) % len(data))
        d = Draws(
            torch.rand(b),
            torch.rand(b),
            torch.rand(b, m.text_len),
            torch.randn(b, m.latent_len, m.latent_dim),
        )
        losses = compute_losses(model, torch.from_numpy(ids), torch.from_numpy(lat), d, objective)
        losses.total.backward()
        torch.nn.utils.clip_grad_norm_(params, t.grad_clip or float("inf"))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return time.perf_counter() - wall, time.process_time() - cpu


def hpclaunch_loop(cfg: RunConfig, run_dir: Path) -> tuple[float, float]:
    """(wall s, CPU s) of ``Trainer.run`` (set-up excluded: data check, model build)."""
    trainer = Trainer(cfg, RunPaths(run_dir).ensure(), attempt="bench", checkpoints=False, echo=False)
    wall, cpu = time.perf_counter(), time.process_time()
    trainer.run()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    trainer.close()
    return wall, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=60, help="steps per round (each loop)")
    ap.add_argument("--rounds", type=int, default=8, help="alternating rounds")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1 = least noise)")
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--workers", type=int, default=0, help="data.num_workers of the hpclaunch loop")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="the smallest sizes, in seconds: that it runs (make test), no figures",
    )
    args = ap.parse_args()
    if args.smoke:
        args.steps, args.rounds, args.log_every = 3, 1, 1
    torch.set_num_threads(args.threads)
    set_deterministic()  # both loops under the same kernel settings
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        base = load_config(None, args.overrides)
        synth_dataset(root / "data", samples=1024, seed=0, model_cfg=base.model)
        overrides = [
            *args.overrides,
            "scheduler.procs_per_node=1",
            f"train.steps={args.steps}",
            f"train.log_every={args.log_every}",
            f"data.num_workers={args.workers}",
            f"data.token_dir={root / 'data/tokens'}",
            f"data.latent_dir={root / 'data/latents'}",
        ]
        cfg = load_config(None, overrides, base=root)
        m = cfg.model
        print(
            f"model: depth {m.depth}, dims ({m.dim_text}, {m.dim_latent}), text {m.text_len} + latent "
            f"{m.latent_len}x{m.latent_dim}, batch {cfg.train.global_batch}, {args.steps} steps x "
            f"{args.rounds} rounds per loop, log_every {args.log_every}, torch threads {args.threads}"
        )
        bare_loop(cfg, 5)  # warm-up: allocator, kernels
        hpclaunch_loop(cfg, root / "warmup")
        rows = []
        for r in range(args.rounds):
            a = bare_loop(cfg, args.steps)
            b = hpclaunch_loop(cfg, root / f"run{r}")
            rows.append((a, b))
            print(
                f"  round {r + 1}: bare {args.steps / a[0]:6.2f} steps/s, hpclaunch {args.steps / b[0]:6.2f} "
                f"steps/s (wall ratio {a[0] / b[0]:.3f}, CPU-time ratio {a[1] / b[1]:.3f})"
            )
        wall_ratio = statistics.median(a[0] / b[0] for a, b in rows)
        cpu_ratio = statistics.median(a[1] / b[1] for a, b in rows)
        best_bare = args.steps / min(a[0] for a, _ in rows)
        best_ours = args.steps / min(b[0] for _, b in rows)
        print(f"bare loop:      {best_bare:.2f} steps/s (best round)")
        print(f"hpclaunch loop: {best_ours:.2f} steps/s (best round)")
        print(f"ratio hpclaunch/bare, best rounds:          {best_ours / best_bare:.3f}")
        print(f"ratio hpclaunch/bare, median of paired wall: {wall_ratio:.3f}")
        print(f"ratio hpclaunch/bare, median of paired CPU:  {cpu_ratio:.3f}")


if __name__ == "__main__":
    main()
