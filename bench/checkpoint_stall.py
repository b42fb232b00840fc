"""How long a checkpoint save blocks training: blocking save vs. async save (single process, CPU).

Builds an MMDiT-sized set of fp32 parameters plus AdamW moments (default ~200 MB in total), then
saves it repeatedly with hpclaunch's Checkpointer, (a) blocking and (b) async, changing the tensors
in place between saves as a training step would. Prints the seconds training was blocked (median
of the repeats, plus the first save, which also allocates the staging buffers), the full save
time (write + hash + publish) and the ratio async/blocking (target <= 0.2). No assertions.

    .venv/bin/python bench/checkpoint_stall.py [--mb 200] [--repeats 5] [--dir /fast/disk]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from hpclaunch.trainer.checkpoint import Checkpointer


def mmdit_like_shapes(dim: int) -> list[tuple[int, ...]]:
    """Parameter shapes of one joint (two-modality) transformer block of width ``dim``."""
    per_modality = [
        (dim, 6 * dim),  # adaLN modulation
        (3 * dim, dim),  # qkv
        (dim, dim),  # attention out
        (4 * dim, dim),  # mlp in
        (dim, 4 * dim),  # mlp out
        (dim,),  # norms / biases
        (dim,),
    ]
    return per_modality * 2


def build_state(total_mb: float, dim: int = 512) -> dict[str, Any]:
    """Params + exp_avg + exp_avg_sq (3 fp32 copies) adding up to about ``total_mb``."""
    model: dict[str, torch.Tensor] = {}
    optim: dict[str, dict[str, torch.Tensor]] = {}
    budget = total_mb * 1e6 / 4 / 3  # fp32 elements per copy
    used, block = 0, 0
    while used < budget:
        for i, shape in enumerate(mmdit_like_shapes(dim)):
            name = f"blocks.{block}.p{i}"
            model[name] = torch.randn(shape)
            optim[name] = {
                "step": torch.tensor(100.0),
                "exp_avg": torch.randn(shape),
                "exp_avg_sq": torch.rand(shape),
            }
            used += model[name].numel()
        block += 1
    return {"model": model, "optim": {"state": optim}, "progress": {"step": torch.tensor(0)}}


def state_bytes(state: dict[str, Any]) -> int:
    total = sum(t.nbytes for t in state["model"].values())
    return total + sum(t.nbytes for p in state["optim"]["state"].values() for t in p.values())


def fake_training_step(state: dict[str, Any]) -> None:
    for t in state["model"].values():
        t.mul_(0.999)


def measure(directory: Path, state: dict[str, Any], *, blocking: bool, repeats: int) -> dict[str, Any]:
    ck = Checkpointer(
        directory,
        rank=0,
        world_size=1,
        config_hash="bench",
        model_hash="bench",
        keep_last=2,
        async_save=not blocking,
    )
    stalls, saves = [], []
    for step in range(repeats + 1):
        fake_training_step(state)
        ck.save(step, state, blocking=blocking)
        assert ck.last_stall_seconds is not None
        stalls.append(ck.last_stall_seconds)
        ck.wait()  # training would run for minutes before the next save
        assert ck.last_save_seconds is not None
        saves.append(ck.last_save_seconds)
    ck.close()
    return {
        "first_stall": stalls[0],
        "stall": statistics.median(stalls[1:]),
        "save": statistics.median(saves[1:]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=200.0, help="total state size in MB")
    parser.add_argument("--repeats", type=int, default=5, help="measured saves per mode")
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir)")
    args = parser.parse_args()

    state = build_state(args.mb)
    print(f"state: {state_bytes(state) / 1e6:.0f} MB fp32 in {len(state['model']) * 4} tensors")
    root = args.dir or Path(tempfile.mkdtemp(prefix="ckpt-bench-"))
    started = time.monotonic()
    blocking = measure(root / "blocking", state, blocking=True, repeats=args.repeats)
    async_ = measure(root / "async", state, blocking=False, repeats=args.repeats)
    print(f"directory: {root}  (took {time.monotonic() - started:.0f} s)")
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{'mode':<10}{'stall median s':>16}{'first stall s':>15}{'save median s':>15}")
    for name, row in (("blocking", blocking), ("async", async_)):
        print(f"{name:<10}{row['stall']:>16.3f}{row['first_stall']:>15.3f}{row['save']:>15.3f}")
    print(f"async/blocking stall ratio: {async_['stall'] / blocking['stall']:.3f} (target <= 0.2)")


if __name__ == "__main__":
    main()
