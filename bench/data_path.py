"""The trainer's data path vs iterating an in-memory tensor of the same data (one process, CPU).

Both produce, step after step, exactly what one training step of rank 0 consumes (token ids,
latents, the text mask and the step's random draws: diffusion times, mask keys, noise) for the
same sample positions, and the bytes are checked equal once:

(a) in-memory: the whole dataset as two torch tensors, indexed in the training order in the main
    thread (the fastest way to hold data, and what the trainer did before shards were mapped);
(b) the trainer's loader: memory-mapped shards read and prepared by ``--workers`` DataLoader
    worker processes (``loader.StepBatches`` + ``make_loader``), ``--prefetch`` steps ahead.

Two consumers: ``data only`` (the loop body does nothing: raw samples/s) and ``with training``
(each item feeds a forward/backward/AdamW step of the model, as in ``Trainer.train_step``: what a
run sees). Rounds alternate (a), (b); reported: median samples/s and the median of paired ratios
(b)/(a), by wall time and by the training process's CPU time (the workers' CPU is their own: that
is the point of them; the CPU ratio is also the least sensitive to other load on the machine).
Goal: >= 0.95 with training. Figures only, no assertions.

    .venv/bin/python bench/data_path.py [--steps 40] [--rounds 5] [--workers 2] [--set model.depth=4 ...]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch

from hpclaunch.config import RunConfig, load_config
from hpclaunch.shards import synth_dataset, validate_dataset
from hpclaunch.trainer.data.dataset import SampleOrder, ShardedDataset, text_mask
from hpclaunch.trainer.data.loader import StepBatches, StepPlan, make_loader, micro_batches
from hpclaunch.trainer.model.mmdit_diffusion import build_model
from hpclaunch.trainer.model.objective import Objective, compute_losses, draw
from hpclaunch.trainer.setup.parallel import set_deterministic


def in_memory_items(
    cfg: RunConfig, ids: torch.Tensor, lat: torch.Tensor, order: SampleOrder, steps: int
) -> Iterable[dict[str, torch.Tensor]]:
    """What StepBatches yields, from tensors held in memory, in the main thread."""
    t, m = cfg.train, cfg.model
    b = t.global_batch
    for i in range(steps):
        index = torch.from_numpy(order.indices(i * b, b))
        tokens, latents = ids.index_select(0, index), lat.index_select(0, index)
        d = draw(t.seed, i + 1, list(range(i * b, (i + 1) * b)), m.text_len, (m.latent_len, m.latent_dim))
        item = {"tokens": tokens[None], "latents": latents[None], "t_text": d.t_text[None]}
        item |= {"t_latent": d.t_latent[None], "keys": d.mask_keys[None], "noise": d.noise[None]}
        item["step"] = torch.tensor(i + 1)
        mask = text_mask(tokens.numpy(), cfg.data.pad_id)
        if mask is not None:
            item["text_mask"] = torch.from_numpy(mask)[None]
        yield item


def loader_items(
    cfg: RunConfig, ds: ShardedDataset, order: SampleOrder, steps: int, workers: int, prefetch: int
) -> Iterable[dict[str, torch.Tensor]]:
    b = cfg.train.global_batch
    plan = StepPlan(
        seed=cfg.train.seed,
        first_step=1,
        first_position=0,
        steps=steps,
        global_batch=b,
        rank=0,
        per_rank=b,
        micro=b,
        pad_id=cfg.data.pad_id,
    )
    return make_loader(
        StepBatches(ds, order, plan), num_workers=workers, prefetch_factor=prefetch, pin_memory=False
    )


def consume(
    items: Iterable[dict[str, torch.Tensor]],
    train: tuple[torch.nn.Module, torch.optim.Optimizer] | None,
    cfg: RunConfig,
) -> tuple[float, float]:
    """(wall s, this process's CPU s) to go through ``items`` (training a step on each when given)."""
    start, cpu = time.perf_counter(), time.process_time()
    for item in items:
        if train is None:
            continue
        model, opt = train
        (mb,) = micro_batches(item, torch.device("cpu"))
        losses = compute_losses(
            model, mb.tokens, mb.latents, mb.draws, Objective.of(cfg), text_mask=mb.text_mask
        )
        losses.total.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return time.perf_counter() - start, time.process_time() - cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument(
        "--workers", type=int, default=1, help="DataLoader workers (the default of data.num_workers)"
    )
    ap.add_argument("--prefetch", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads of the training process")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="the smallest sizes, in seconds: that it runs (make test), no figures",
    )
    args = ap.parse_args()
    if args.smoke:
        args.steps, args.rounds = 2, 1
    torch.set_num_threads(args.threads)
    set_deterministic()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        cfg = load_config(None, ["train.global_batch=32", "data.pad_id=0", *args.overrides], base=root)
        synth_dataset(
            root / "d", samples=4096, seed=0, model_cfg=cfg.model, shard_size=512, pad_id=cfg.data.pad_id
        )
        ds = ShardedDataset(
            validate_dataset(root / "d" / "tokens", root / "d" / "latents", cfg.model), cfg.model
        )
        ids_np, lat_np = ds.get(np.arange(ds.num_samples))
        ids, lat = torch.from_numpy(ids_np), torch.from_numpy(lat_np)
        order = SampleOrder(ds.num_samples, cfg.train.seed)
        first_a = next(iter(in_memory_items(cfg, ids, lat, order, 1)))
        first_b = next(iter(loader_items(cfg, ds, order, 1, 0, args.prefetch)))
        assert all(torch.equal(first_a[k], first_b[k]) for k in first_b), (
            "the two paths must yield the same bytes"
        )
        m = cfg.model
        print(
            f"{ds.num_samples} samples in {len(ds.info.shards)} shards; batch {cfg.train.global_batch}, text {m.text_len} "
            f"(padded) + latent {m.latent_len}x{m.latent_dim}; {args.steps} steps x {args.rounds} rounds; "
            f"loader: {args.workers} workers, prefetch {args.prefetch}; torch threads {args.threads}"
        )
        model = build_model(m, seed=0)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        b = cfg.train.global_batch
        for label, train in (("data only", None), ("with training", (model, opt))):
            consume(loader_items(cfg, ds, order, 3, args.workers, args.prefetch), train, cfg)  # warm-up
            pairs = []
            for _ in range(args.rounds):
                a = consume(in_memory_items(cfg, ids, lat, order, args.steps), train, cfg)
                bb = consume(
                    loader_items(cfg, ds, order, args.steps, args.workers, args.prefetch), train, cfg
                )
                pairs.append((a, bb))
            mem = statistics.median(args.steps * b / a[0] for a, _ in pairs)
            ours = statistics.median(args.steps * b / x[0] for _, x in pairs)
            ratio = statistics.median(a[0] / x[0] for a, x in pairs)
            cpu = statistics.median(a[1] / x[1] for a, x in pairs)
            print(
                f"{label:>13}: in-memory {mem:8.1f} samples/s, loader {ours:8.1f} samples/s; loader/in-memory: "
                f"wall {ratio:.3f}, training process CPU {cpu:.3f} (medians of {args.rounds} paired rounds)"
            )


if __name__ == "__main__":
    main()
