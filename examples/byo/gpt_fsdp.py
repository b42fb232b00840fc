"""Train a small GPT with FSDP2 (``fully_shard`` per block and on the root), batches drawn as
nanoGPT does (random windows of the corpus, from each rank's torch generator): a plain torch
script, runnable with python or torchrun.

The lines marked ``# hpclaunch`` are all it takes: attach restores the sharded model and optimizer
(at any world size, through torch's distributed state-dict helpers), each rank's random state (so
the next batch drawn is the one an uninterrupted run would draw) and the step.

    torchrun --nproc-per-node 2 gpt_fsdp.py --steps 200
    hpclaunch train --script gpt_fsdp.py --set scheduler.procs_per_node=2 -- --steps 200
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from gpt import GPT, synthetic_corpus
from torch.distributed.fsdp import fully_shard

import hpclaunch  # hpclaunch

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=200)
p.add_argument("--batch", type=int, default=8, help="sequences per rank and step")
p.add_argument("--block", type=int, default=32)
p.add_argument("--layers", type=int, default=2)
p.add_argument("--d-model", type=int, default=64)
p.add_argument("--lr", type=float, default=3e-3)
p.add_argument("--sleep", type=float, default=0.0, help="seconds added to each step (tests)")
args = p.parse_args()

cuda = torch.cuda.is_available()
if "WORLD_SIZE" not in os.environ:  # one process: a group of one (FSDP2 needs a group)
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29511")
dist.init_process_group("nccl" if cuda else "gloo")
rank = dist.get_rank()
device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
if cuda:
    torch.cuda.set_device(device)

torch.manual_seed(0)
model = GPT(vocab=64, block=args.block, n_layer=args.layers, n_head=4, d_model=args.d_model).to(device)
for block in model.blocks:
    fully_shard(block)
fully_shard(model)
opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
corpus = synthetic_corpus(vocab=64, length=20_000)
torch.manual_seed(1000 + rank)  # each rank its own batches and dropout


def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
    starts = torch.randint(len(corpus) - args.block - 1, (args.batch,))
    x = torch.stack([corpus[i : i + args.block] for i in starts])
    y = torch.stack([corpus[i + 1 : i + args.block + 1] for i in starts])
    return x.to(device), y.to(device)


meta = {"tokens_seen": 0}
run = hpclaunch.attach(model=model, optimizer=opt, extra=meta)  # hpclaunch
for step in run.steps(total=args.steps):  # hpclaunch
    x, y = get_batch()  # drawn inside the step: a resume draws it again, the same
    loss = model(x, y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    meta["tokens_seen"] += x.numel() * dist.get_world_size()
    if step % 10 == 0 or step == args.steps:
        run.log(loss=loss.item(), tokens=meta["tokens_seen"])  # hpclaunch
    if args.sleep:
        import time

        time.sleep(args.sleep)

dist.destroy_process_group()
