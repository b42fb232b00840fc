"""A blocking save with ``checkpoint.write_threads`` N against 1, in the same process, alternating.

The trainer's own ``Checkpointer`` (DCP write with ``sync_files``, the sha256 of every file, the
manifest, publish by rename) saves the same state, one thread and N threads in turn, ``--rounds``
times each; it prints the median seconds of each and their ratio. Why: one H200 run wrote an 18.6 GB
checkpoint at 0.39 GB/s with DCP's single writer thread (docs/figures.md).

    .venv/bin/python bench/save_threads.py --gb 1.5 --threads 2 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from hpclaunch.rank.checkpoint import Checkpointer, RunCheckpoints, WriterSettings


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=1.5, help="state size in GB (fp32 tensors of 16 MB)")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write (default: the system's tmp)")
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="the smallest sizes, in seconds: that it runs (make test), no figures",
    )
    args = ap.parse_args()
    if args.smoke:
        args.gb, args.rounds, args.threads = 0.05, 1, 2
    tensors = max(1, int(args.gb * 1e9 / 16e6))
    state = {"model": {f"w{i}": torch.randn(4_000_000) for i in range(tensors)}}
    nbytes = tensors * 16e6
    times: dict[int, list[float]] = {1: [], args.threads: []}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        step = 0
        for _ in range(args.rounds):
            for threads in (1, args.threads):
                step += 1
                where = Path(tmp) / f"t{threads}"
                ck = Checkpointer(
                    RunCheckpoints(where, 1, config_hash="c", model_hash="m", keep_last=1),
                    rank=0,
                    writing=WriterSettings(write_threads=threads),
                )
                begun = time.perf_counter()
                ck.save(step, state, blocking=True)
                times[threads].append(time.perf_counter() - begun)
                ck.close()
                shutil.rmtree(where)
    one, many = statistics.median(times[1]), statistics.median(times[args.threads])
    print(f"blocking save of {nbytes / 1e9:.2f} GB, median of {args.rounds}:")
    print(f"  1 thread:  {one:.2f} s ({nbytes / one / 1e9:.2f} GB/s)")
    print(f"  {args.threads} threads: {many:.2f} s ({nbytes / many / 1e9:.2f} GB/s)")
    print(f"  ratio {many / one:.2f} (threads / one; lower is faster), load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
