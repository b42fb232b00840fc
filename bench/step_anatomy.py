"""The anatomy of one training step without a GPU: what the host does, eager and compiled.

On a GPU every aten op the host dispatches is at least one kernel launch (~5-20 us of host time in
eager mode), and every host sync stops the host from running ahead of the device. A deep, narrow
MMDiT on the CPU has negligible FLOPs, so its step time is that host work alone: these are the
figures that move with the step's fixes in a session that has no GPU (docs/figures.md, "The step").

The real step (``Trainer.train_step`` and the metrics window's ``add``, as the loop calls them:
forward and backward of every micro-batch, the NaN guard, the global grad norm, clipping, AdamW,
the EMA), fp32, one rank: the model itself, as on one GPU (``train.parallel: fsdp`` is set, and one
rank trains unwrapped: ``trainer.setup.parallel.wrap_model``). For ``eager`` and ``compiled``
(``train.compile``: each MMDiT block compiled once, reused by the identical blocks), after warm-up:

- ``ops_per_step``: aten ops dispatched (a ``TorchDispatchMode`` counts every op below autograd;
  a compiled region's fused kernels are not aten ops, its extern calls such as matmuls are);
- ``host_syncs_per_step``: ops that make the host wait for a device's result (``.item()``, which is
  ``_local_scalar_dense``, ``nonzero``, boolean indexing, ``masked_select``, ``unique``, ...);
- ``host_ms_per_step``: the step's wall time, measured without the counting mode;
- ``ops_per_block``: aten ops of one block's forward (``eager`` only; the compiled block's are
  listed beside it).

Prints a table, then with ``--json`` one JSON line: ``{"eager": {...}, "compiled": {...}}``.

    .venv/bin/python bench/step_anatomy.py [--json] [--depth 12] [--steps 6]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch._inductor.config

from hpclaunch.config import load_config
from hpclaunch.rundir import RunPaths
from hpclaunch.shards import synth_dataset
from hpclaunch.trainer.loop import Trainer

# aten ops after which the host holds a value computed on the device (a sync on CUDA)
SYNC_OPS = {
    "_local_scalar_dense", "nonzero", "nonzero_static", "masked_select", "is_nonzero", "equal",
    "unique", "_unique", "_unique2", "unique_consecutive", "unique_dim", "repeat_interleave",
    "masked_scatter", "allclose", "item",
}  # fmt: skip

NARROW = [
    "model.dim_text=32", "model.dim_latent=32", "model.dim_cond=32", "model.heads=2", "model.dim_head=16",
    "model.text_len=16", "model.latent_len=4", "model.latent_dim=8", "model.vocab_size=64",
]  # fmt: skip


def _inside_op(event: Any) -> bool:
    """Whether an aten op ran inside another one (a composite's parts, a CPU foreach's per-tensor
    loop, a kernel reading a host scalar): those are not dispatched by the step itself."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("aten::"):
            return True
        parent = parent.cpu_parent
    return False


class OpCounter:
    """Counts what a step dispatches, with ``torch.profiler`` on the host: every aten op called by the
    step itself (from Python, the autograd engine or compiled code; not the ops a composite or a
    CPU foreach runs inside itself: on a GPU a foreach op is one kernel over many tensors) and
    every kernel of a compiled region (inductor names each one in the profile when
    ``cpp.enable_kernel_profile`` is set, as here). A ``TorchDispatchMode`` would not do: Dynamo
    runs compiled code eagerly under one."""

    def __init__(self) -> None:
        self.ops: Counter[str] = Counter()
        self._prof: Any = None

    def __enter__(self) -> OpCounter:
        from torch.profiler import ProfilerActivity, profile

        self._prof = profile(activities=[ProfilerActivity.CPU])
        self._prof.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._prof.__exit__(*exc)
        for e in self._prof.events():
            if e.name.startswith("aten::"):
                if not _inside_op(e):
                    self.ops[e.name.removeprefix("aten::")] += 1
            elif "cpp_fused" in e.name or "triton_" in e.name:
                self.ops["<compiled kernel>"] += 1

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    @property
    def syncs(self) -> int:
        return sum(n for name, n in self.ops.items() if name in SYNC_OPS)


def one_step(trainer: Trainer, batches: Any) -> None:
    item = next(batches)
    applied, loss, text, latent, norm = trainer.train_step(item)
    trainer.reports.window.add(loss, text, latent, norm, ok=applied, step_time_s=0.0)


def measure(name: str, root: Path, base: list[str], steps: int, warmup: int) -> dict[str, Any]:
    extra = ["train.compile=true"] if name == "compiled" else []
    cfg = load_config(None, [*base, *extra], base=root)
    trainer = Trainer(cfg, RunPaths(root / name).ensure(), checkpoints=False, echo=False)
    try:
        batches = iter(trainer.feed.loader(trainer.data))
        for _ in range(warmup):  # compilation, the optimizer's state, the allocator's pools
            one_step(trainer, batches)
        counts = []
        for _ in range(steps):
            counter = OpCounter()
            with counter:
                one_step(trainer, batches)
            counts.append(counter)
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            one_step(trainer, batches)
            times.append((time.perf_counter() - t0) * 1000)
        blocks: Any = trainer.model.trunk.blocks  # type: ignore[union-attr]
        d, b = cfg.model, trainer.feed.micro
        text, lat = torch.randn(b, d.text_len, d.dim_text), torch.randn(b, d.latent_len, d.dim_latent)
        for _ in range(2):  # the first compiles the block for no_grad
            with torch.no_grad(), OpCounter() as block:  # one block's forward, training's shapes
                blocks[0](modality_tokens=(text, lat), time_cond=torch.randn(b, d.dim_cond))
        last = counts[-1]
        return {
            "ops_per_step": statistics.median(c.total for c in counts),
            "host_syncs_per_step": statistics.median(c.syncs for c in counts),
            "host_ms_per_step": statistics.median(times),
            "ops_per_block_forward": block.total,
            "top_ops": dict(last.ops.most_common(12)),
            "sync_ops": {k: v for k, v in last.ops.items() if k in SYNC_OPS},
        }
    finally:
        trainer.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--depth", type=int, default=12, help="MMDiT blocks (deep: the host work grows with it)")
    ap.add_argument("--steps", type=int, default=6, help="steps counted and timed, after warm-up")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--parts", default="eager,compiled", help="eager, compiled or both (comma-separated)")
    ap.add_argument("--json", action="store_true", help="end with one JSON line of the figures")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="the smallest sizes, in seconds: that it runs (make test), no figures",
    )
    args = ap.parse_args()
    if args.smoke:
        args.depth, args.steps, args.warmup, args.parts = 1, 1, 1, "eager"
    torch._inductor.config.cpp.enable_kernel_profile = True  # compiled kernels named in the profile
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(var, None)  # one process of its own, whatever launched it
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        base = [
            *NARROW, f"model.depth={args.depth}", "scheduler.procs_per_node=1", "train.parallel=fsdp",
            "train.global_batch=4", "train.micro_batch=2", "train.ema_decay=0.999", "train.grad_clip=1.0",
            f"train.steps={args.warmup + 2 * args.steps + 1}", "train.warmup_steps=1", "data.num_workers=0",
            "preflight.distributed_smoke=false", f"data.token_dir={root / 'd' / 'tokens'}",
            f"data.latent_dir={root / 'd' / 'latents'}", *args.overrides,
        ]  # fmt: skip
        synth_dataset(root / "d", samples=64, seed=0, model_cfg=load_config(None, base).model)
        results = {name: measure(name, root, base, args.steps, args.warmup) for name in args.parts.split(",")}
    print(f"the step's anatomy: depth {args.depth}, one CPU rank (no wrapper), fp32 (host work only)")
    for name, r in results.items():
        print(
            f"  {name:>8}: {r['ops_per_step']:7.0f} aten ops/step ({r['ops_per_block_forward']} in one block's "
            f"forward), {r['host_syncs_per_step']:.0f} host syncs/step {r['sync_ops']}, "
            f"{r['host_ms_per_step']:.1f} ms/step"
        )
    if "eager" in results and "compiled" in results:
        e, c = results["eager"], results["compiled"]
        print(
            f"  compiled/eager: ops {c['ops_per_step'] / e['ops_per_step']:.3f}x, "
            f"host time {c['host_ms_per_step'] / e['host_ms_per_step']:.2f}x"
        )
    if args.json:
        keys = ("ops_per_step", "host_syncs_per_step", "host_ms_per_step")
        print(json.dumps({name: {k: r[k] for k in keys} for name, r in results.items()}))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
